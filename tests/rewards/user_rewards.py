"""User reward functions with verl's signature, imported by the reward service in tests."""


def exact(data_source, solution_str, ground_truth, extra_info):
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def with_details(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.25, "source": data_source, "n": len(solution_str)}


def broken(data_source, solution_str, ground_truth, extra_info):
    return "not a number"


def runaway(data_source, solution_str, ground_truth, extra_info):
    """Never returns for the response 'spin'; asks for 3 GiB at once for 'hog'; else 0."""
    while solution_str == "spin":
        pass
    if solution_str == "hog":
        return float(len(bytearray(3 * 2**30)))  # zero pages: costs nothing unless refused
    return 0.0


def slow_length(data_source, solution_str, ground_truth, extra_info):
    """len(solution_str), after touching the file named by POSTTRAIN_TEST_SCORING_MARK
    (scoring has begun) and sleeping 0.5 s: a request a fault drill can kill mid-way."""
    import os
    import time
    from pathlib import Path

    if mark := os.environ.get("POSTTRAIN_TEST_SCORING_MARK"):
        Path(mark).touch()
    time.sleep(0.5)
    return float(len(solution_str))


def extra_index(data_source, solution_str, ground_truth, extra_info):
    """verl's extra_info: the row's `extra_info` column (its `index`)."""
    return float(extra_info["index"])


def echo_number(data_source, solution_str, ground_truth, extra_info):
    """float(solution_str) ('nan', 'inf', '1e400' included); for 'details' a dict whose
    extra key is NaN."""
    if solution_str == "details":
        return {"score": 0.5, "ratio": float("nan")}
    return float(solution_str)
