"""Built-in `math` reward: does the response's final answer equal the ground truth?

Uses `math-verify` (parsing to SymPy, symbolic comparison) on the response only,
never the prompt.

Ground truths: bare LaTeX as MATH writes them (`2\\sqrt{2}`, `\\frac{\\sqrt{3}}{2}`,
`(1,2)`, `\\{1,2\\}`), plain numbers (`1234`, `-7`, `+7`, `3/4`, `0.5`, `1,234`),
GSM8K solutions (the value after the last `#### `), or text already holding
`$...$` / `\\boxed{}`. A bare gold is read as the contents of `\\boxed{}`, so LaTeX is
parsed whole rather than cut to its first number. An equation keeps its right-hand
side (`x = 5` is 5) unless it has several parts separated by commas. A gold with
nothing parseable fails the item (`ValueError`), it is never silently 0.

Which answer of the response counts:
1. The last explicit marker that holds a value: `\\boxed{...}`, a `#### ...` line, or
   an answer phrase (`the answer is ...`, `Answer: ...`; see rewards/math_answer.py).
   Text after it (a model that keeps talking) is ignored, and so are trailing
   numbers: `#### 42` then "this matches step 3" is 42. A marker with no value
   ("the answer is consistent with...", `\\boxed{}`) is skipped for the one before.
   Of a phrase or `####` line, the value is what the line starts with, up to the
   sentence's end or its first word ("1,234 dollars." is 1,234).
2. With no marker: math-verify's own extraction on the whole response (LaTeX
   environments, then the last number or expression).
Hedging is not rewarded: when the counted marker offers alternatives joined by "or"
(`The answer is 1234 or maybe 12`, `\\boxed{3 \\text{ or } 4}`) that are not all equal,
the score is 0 (details `hedged: true`), even if one of them is right. Alternatives
that agree ("1/2, or equivalently 0.5") and golds that are themselves sets or
intervals (where "x = 2 or x = -3" lists the set) are not hedges. A hedge outside any
marker is not detected: there the last value counts.

Limits: math-verify and SymPy can take unbounded time and memory on hostile input
(`9^{9^{9^{9^{9}}}}`, `1000000!`); their own SIGALRM timeouts are off here because
they cannot interrupt C code. The reward service therefore runs this function only in
a killable worker process with a per-call deadline (rewards/bounded.py); do not call
it from a server thread on untrusted text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from .math_answer import (
    alternatives,
    find_markers,
    last_side,
    leading_value,
    sentence,
    strip_plus,
)

# math-verify warns on every call that its SIGALRM timeout is off; we know (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)

_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_MAX_MARKERS = 8  # markers tried, from the last one back


def _parse(text: str) -> list[Any]:
    return parse(text, extraction_config=_CONFIG, parsing_timeout=None)


def parse_value(value: str) -> list[Any]:
    """A bare answer (a gold, or a marker's value) parsed by math-verify: as the contents
    of `\\boxed{}` first, then as plain text. Empty list when nothing parses."""
    v = last_side(strip_plus(value.strip()))
    if not v:
        return []
    return _parse("\\boxed{" + v + "}") or _parse(v)


@lru_cache(maxsize=4096)
def parse_gold(ground_truth: str) -> tuple[Any, ...]:
    """The parsed ground truth (cached: every sample of a group shares it)."""
    g = ground_truth.strip()
    if "####" in g:
        g = g.rsplit("####", 1)[1].strip()
    if any(env in g for env in ("\\boxed", "\\fbox", "$", "\\(", "\\[")):
        return tuple(_parse(strip_plus(g)))
    return tuple(parse_value(g))


def _is_multi(gold: list[Any]) -> bool:
    return any(isinstance(g, sympy.Set | sympy.Tuple) for g in gold)


@dataclass(frozen=True)
class Answer:
    """The answer a response commits to: math-verify's parse, where it came from
    ("boxed", "####", "answer phrase", "last value", or None when nothing was found)
    and whether it hedges between different values."""

    parsed: list[Any]
    source: str | None
    hedged: bool


def _differ(values: list[list[Any]]) -> bool:
    return any(not verify(values[0], v, timeout_seconds=None) for v in values[1:])


def final_answer(response: str, multi_valued_gold: bool = False) -> Answer:
    """The answer that counts in `response` (see the module docstring for the rules)."""
    for marker in reversed(find_markers(response)[-_MAX_MARKERS:]):
        whole = marker.text if marker.source == "boxed" else sentence(marker.text)
        parts = alternatives(whole)
        if len(parts) > 1 and multi_valued_gold:
            value = ", ".join(last_side(leading_value(p)) for p in parts)
        else:
            value = whole if marker.source == "boxed" else leading_value(marker.text)
        parsed = parse_value(value)
        if not parsed:
            continue
        hedged = False
        if len(parts) > 1 and not multi_valued_gold:
            offered = [v for v in (parse_value(leading_value(p)) for p in parts) if v]
            hedged = len(offered) > 1 and _differ(offered)
        return Answer(parsed, marker.source, hedged)
    parsed = _parse(strip_plus(response))
    return Answer(parsed, "last value" if parsed else None, False)


def score_math(response: str, ground_truth: str | None) -> tuple[float, dict[str, Any]]:
    """1.0 if the response's final answer equals `ground_truth`, else 0.0.

    Details: `extracted` (the answer as text, or None), `source` (which rule found it)
    and `hedged` (alternatives offered: scored 0).

    Raises:
        ValueError: no ground truth given, or one math-verify cannot parse (the item
            cannot be scored; fix the dataset's answer column).
    """
    if ground_truth is None or not str(ground_truth).strip():
        raise ValueError("the math reward needs a ground_truth for every item")
    gold = list(parse_gold(str(ground_truth)))
    if not gold:
        raise ValueError(
            f"ground_truth {str(ground_truth)[:80]!r} has no answer math-verify "
            "can parse; give a number or LaTeX"
        )
    answer = final_answer(response, _is_multi(gold))
    pred = answer.parsed
    ok = bool(pred) and not answer.hedged and verify(gold, pred, timeout_seconds=None)
    return (1.0 if ok else 0.0), {
        "extracted": str(pred[-1]) if pred else None,
        "source": answer.source,
        "hedged": answer.hedged,
    }
