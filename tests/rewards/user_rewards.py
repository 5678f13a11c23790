"""User reward functions with verl's signature, imported by the reward service in tests."""


def exact(data_source, solution_str, ground_truth, extra_info):
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def with_details(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.25, "source": data_source, "n": len(solution_str)}


def broken(data_source, solution_str, ground_truth, extra_info):
    return "not a number"
