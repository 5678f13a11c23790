"""Finiteness as training sees it: rewards, returns and advantages become float32
tensors, where any magnitude above 3.4028235e38 is `inf` (1e39 is finite as a Python
float and `inf` in float32, and one such reward turns its group's advantages into NaN).
Every check of a number from outside (a reward function, an HTTP endpoint, a reward
model, an environment's step reward, an agent's posted reward) uses `finite32`."""

from __future__ import annotations

import math
from typing import Any

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max


def finite32(x: Any) -> bool:
    """Whether `x` is an int or float (not a bool) that is finite and stays finite as a
    float32 (|x| ≤ 3.4028234663852886e38)."""
    return (
        isinstance(x, int | float)
        and not isinstance(x, bool)
        and math.isfinite(x)
        and abs(x) <= FLOAT32_MAX
    )
