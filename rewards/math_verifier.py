"""Built-in `math` reward: does the response's final answer equal the ground truth?

Uses `math-verify` on the response only, never the prompt. It finds answers in
`\\boxed{}`, LaTeX, GSM8K's `#### N`, or a final number (thousands separators and
fractions included), and compares them symbolically.

Limits: math-verify's own time limit relies on SIGALRM, which only works in a main
thread; the service runs verifiers in worker threads, so that limit is off and a
pathological expression can take long (the client's request timeout bounds it).
"""

from __future__ import annotations

import logging
from typing import Any

from math_verify import parse, verify

# math-verify warns on every call that its SIGALRM timeout is off; we know (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _clean(text: str) -> str:
    # GSM8K's "#### 72" is not an extraction pattern math-verify knows; keep the tail.
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text


def score_math(response: str, ground_truth: str | None) -> tuple[float, dict[str, Any]]:
    """1.0 if the final answer matches `ground_truth`, else 0.0, with what was extracted.

    Raises:
        ValueError: no ground truth given (the item cannot be scored).
    """
    if ground_truth is None or not str(ground_truth).strip():
        raise ValueError("the math reward needs a ground_truth for every item")
    gold = parse(_clean(str(ground_truth)), parsing_timeout=None)
    pred = parse(_clean(response), parsing_timeout=None)
    extracted = str(pred[-1]) if pred else None
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)
    return (1.0 if ok else 0.0), {"extracted": extracted}
