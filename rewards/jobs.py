"""The verifier calls that the reward service runs in its bounded worker processes
(rewards/bounded.py): module-level functions, so they are sent by reference.

Imported once by the forkserver the workers are forked from, so each worker starts
with math-verify and SymPy already loaded.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from .math_verifier import score_math
from .protocol import ScoreItem
from .python_reward import load_function, score_python
from .reasoning_gym import score_reasoning_gym


def math_job(response: str, ground_truth: str | None) -> tuple[float, dict[str, Any]]:
    """`score_math` (rewards/math_verifier.py)."""
    return score_math(response, ground_truth)


def format_job(pattern: str, response: str) -> tuple[float, dict[str, Any]]:
    """1.0 if `pattern` (re.DOTALL) is found in `response`, else 0.0."""
    return (1.0 if re.search(pattern, response, re.DOTALL) else 0.0), {}


@lru_cache(maxsize=64)
def _function(spec: str) -> Any:
    return load_function(spec)


def python_job(spec: str, item: ScoreItem) -> tuple[float, dict[str, Any]]:
    """The user function `spec` ('module:function') on `item`, imported once per worker."""
    return score_python(_function(spec), item)


def reasoning_gym_job(
    response: str, ref: Any, answer_tag: str | None
) -> tuple[float, dict[str, Any]]:
    """`score_reasoning_gym` (rewards/reasoning_gym.py)."""
    return score_reasoning_gym(response, ref, answer_tag)
