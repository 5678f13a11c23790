"""An example user reward with verl's signature, for `type: python` rewards.

    rewards:
      - {name: brief, type: python, function: "my_reward:compute_score", weight: 0.2}

The reward service imports it (put this folder on PYTHONPATH) and calls it once per
rollout. Return a float, or a dict with a numeric "score" plus anything to log.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info):
    """1.0 for an answer of at most 12 characters, falling to 0 at 60: rewards brevity."""
    n = len(solution_str.strip())
    score = 1.0 if n <= 12 else max(0.0, 1.0 - (n - 12) / 48)
    return {"score": score, "chars": n}
