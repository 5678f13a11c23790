"""Built-in `math` reward: does the response's final answer equal the ground truth?

Uses `math-verify` (parsing to SymPy, symbolic comparison) on the response only,
never the prompt.

Ground truths: bare LaTeX as MATH writes them (`2\\sqrt{2}`, `\\frac{\\sqrt{3}}{2}`,
`(1,2)`, `\\{1,2\\}`), plain numbers (`1234`, `-7`, `+7`, `3/4`, `0.5`, `1,234`),
GSM8K solutions (the value after the last `#### `), or text already holding
`$...$` / `\\boxed{}`. A bare gold is read as the contents of `\\boxed{}`, so LaTeX is
parsed whole rather than cut to its first number. A gold with nothing parseable fails
the item (`ValueError`), it is never silently 0.

Equations (one `=`; a chain `2 + 3 = 5 = x` counts by its last side, and parts
separated by commas are a set): the gold's form decides how they compare.
- A gold value (`5`), a gold naming a value (`x = 5`) or a computation (`2 + 3 = 5`):
  the answer's value counts, and an answer that is an equation or a chain counts by its
  last right-hand side (`x = 5`, `y = 5` and `2 + 3 = 5` all answer 5). But a gold
  `x = 2` is not answered by an equation that still has to be solved (`2x = 4`: 0).
- A gold relation between unknowns (`3x + 4y + 14 = 0`, `y = 2x + 3`, `2x = 4`): the
  answer must be the same equation, equal after moving terms across and multiplying
  both sides by a nonzero constant (`4y + 3x = -14` and `6x + 8y + 28 = 0` are 1;
  `3x - y + 13 = 0` is 0 although both right-hand sides are 0), or one math-verify
  solves to the same solutions. So `x = 2` answers a gold `2x = 4` (the same equation
  halved), while `2x = 4` does not answer a gold `x = 2` (above). A bare value answers
  a gold `y = 2x + 3` by its right-hand side (`2x + 3`), never a gold whose left side
  is not one name (`3x + 4y + 14 = 0` is not answered by `0`).

Which answer of the response counts:
1. The last explicit marker that holds a value: `\\boxed{...}`, a `#### ...` line, or
   an answer phrase (`the answer is ...`, `Answer: ...`; see rewards/math_answer.py).
   Text after it (a model that keeps talking) is ignored, and so are trailing
   numbers: `#### 42` then "this matches step 3" is 42. A marker with no value
   ("the answer is consistent with...", `\\boxed{}`) is skipped for the one before.
   Of a phrase or `####` line, the value is what the line starts with, up to the
   sentence's end or its first word ("1,234 dollars." is 1,234), without Markdown
   emphasis, and a `$` nothing closes on the line is currency ("The answer is $1,234."
   is 1,234). A `####` line or phrase followed by words, not a value (`#### Check`,
   `#### All 3 steps verified.`, "the answer is (see above)"), is not a marker, so it
   never outranks an explicit answer before it. A full stop ending any marker's value
   is punctuation (`\\boxed{1,234.}` is 1,234).
2. With no marker: math-verify's own extraction on the whole response (LaTeX
   environments, then the last number or expression), except that a computation of
   plain numbers not carried out is not an answer: a reply that restates the question
   ("To calculate 6 + 6", cut there by a stop string) would otherwise score as 12. Then
   the last number that is no operand of a computation counts ("12, since 6 + 6" is
   12), or nothing does (source None, score 0). An explicit marker's computation
   (`\\boxed{6 + 6}`, "The answer is 6 + 6") is the reply's own commitment and still
   counts by its value.
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
    is_computation,
    is_prose,
    last_result,
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


def _parse_bare(v: str) -> list[Any]:
    return (_parse("\\boxed{" + v + "}") or _parse(v)) if v else []


def parse_value(value: str) -> list[Any]:
    """A bare answer (a gold, or a marker's value) parsed by math-verify: as the contents
    of `\\boxed{}` first, then as plain text. An equation is kept whole (a sympy `Eq`;
    `same_answer` decides how it compares); a chain `a = b = c`, or an equation that does
    not parse whole, is cut to its last side. A full stop at the end is punctuation
    (`\\boxed{1,234.}` is 1,234). Empty list when nothing parses."""
    v = strip_plus(value.strip())
    if v.endswith(".") and not v.endswith(".."):
        v = v[:-1].rstrip()
    if last_side(v) != v:  # one equation (no comma-separated parts)
        whole = _parse_bare(v)
        if _relation(whole) is not None:
            return whole
        v = last_side(v)
    return _parse_bare(v)


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


def _relation(parsed: list[Any]) -> sympy.Eq | None:
    """The equation a parse states (its first element is a sympy `Eq`), else None."""
    return parsed[0] if parsed and isinstance(parsed[0], sympy.Eq) else None


def _names_a_value(rel: sympy.Eq | None) -> bool:
    """A plain value, a computation (`2 + 3 = 5`: no unknowns) or a name given a value
    (`x = 5`): answered by a value, not by an equation to solve."""
    return rel is None or not rel.free_symbols or (rel.lhs.is_Symbol and not rel.rhs.free_symbols)


def _as_value(parsed: list[Any]) -> list[Any]:
    """An equation's last right-hand side (`x = 5` → 5); other parses unchanged."""
    rel = _relation(parsed)
    if rel is None:
        return parsed
    return [rel.rhs, *(last_side(p) for p in parsed[1:] if isinstance(p, str))]


def _same_equation(gold: sympy.Eq, pred: sympy.Eq) -> bool:
    """`pred` is `gold` with terms moved across and both sides times a nonzero constant:
    (gold.lhs - gold.rhs) / (pred.lhs - pred.rhs) simplifies to a finite nonzero number."""
    try:
        ratio = sympy.simplify((gold.lhs - gold.rhs) / (pred.lhs - pred.rhs))
    # sympy raises assorted types on odd input; an equation it cannot divide is not this one
    except Exception:  # noqa: BLE001
        return False
    return bool(ratio.is_number and ratio.is_finite and ratio.is_zero is False)


def same_answer(gold: list[Any], pred: list[Any]) -> bool:
    """Whether the parsed answer `pred` equals the parsed `gold` (math-verify's `verify`,
    with equations compared as the module docstring says: the gold's form decides)."""
    g_rel, p_rel = _relation(gold), _relation(pred)
    if _names_a_value(g_rel):
        if g_rel is not None and not _names_a_value(p_rel):
            return False  # `x = 2` is not answered by `2x = 4`
        return verify(_as_value(gold), _as_value(pred), timeout_seconds=None)
    if p_rel is not None and p_rel.free_symbols:
        return _same_equation(g_rel, p_rel) or verify(gold, pred, timeout_seconds=None)
    # a bare value (or a computation) answers `y = 2x + 3` by its right-hand side
    return g_rel.lhs.is_Symbol and verify(_as_value(gold), _as_value(pred), timeout_seconds=None)


@dataclass(frozen=True)
class Answer:
    """The answer a response commits to: math-verify's parse, where it came from
    ("boxed", "####", "answer phrase", "last value", or None when nothing was found)
    and whether it hedges between different values."""

    parsed: list[Any]
    source: str | None
    hedged: bool


def _differ(values: list[list[Any]]) -> bool:
    return any(not same_answer(values[0], v) for v in values[1:])


def final_answer(response: str, multi_valued_gold: bool = False) -> Answer:
    """The answer that counts in `response` (see the module docstring for the rules)."""
    for marker in reversed(find_markers(response)[-_MAX_MARKERS:]):
        whole = marker.text if marker.source == "boxed" else sentence(marker.text)
        parts = alternatives(whole)
        if len(parts) > 1 and multi_valued_gold:
            value = ", ".join(last_side(leading_value(p)) for p in parts)
        else:
            value = whole if marker.source == "boxed" else leading_value(marker.text)
        if marker.source != "boxed" and is_prose(value):
            continue  # "#### (verified)": words, not a value
        parsed = parse_value(value)
        unread = all(isinstance(p, str) for p in parsed)  # text math-verify could not read
        if not parsed or (unread and marker.source != "boxed" and len(parts) == 1):
            continue  # nothing, or nothing but "#### ---"
        hedged = False
        if len(parts) > 1 and not multi_valued_gold:
            offered = [v for v in (parse_value(leading_value(p)) for p in parts) if v]
            hedged = len(offered) > 1 and _differ(offered)
        return Answer(parsed, marker.source, hedged)
    parsed = _parse(strip_plus(response))
    if parsed and isinstance(parsed[-1], str) and is_computation(parsed[-1]):
        # the last expression is a computation the reply restates, not its answer
        result = last_result(response)
        parsed = parse_value(result) if result is not None else []
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
    ok = bool(pred) and not answer.hedged and same_answer(gold, pred)
    return (1.0 if ok else 0.0), {
        "extracted": str(pred[-1]) if pred else None,
        "source": answer.source,
        "hedged": answer.hedged,
    }
