"""Where a response states its final answer: pure text scanning for the `math` reward.

Explicit markers, in the order they appear in the response:
- `\\boxed{...}` / `\\fbox{...}` (balanced braces; `\\{` `\\}` are literal braces);
- GSM8K's `#### ...` (the rest of that line);
- an answer phrase: `answer is ...`, `answer: ...`, `answer = ...` (any case, optional
  `final` and Markdown bold).
A `####` line or a phrase is a marker only when what follows it on the same line looks
like a value (after optional Markdown emphasis: a digit, a sign, `$`, a backslash, a
bracket, or a one-letter name); prose such as "the answer is consistent with step 3",
or a Markdown heading such as `#### Check` or `#### All 3 steps verified.`, is not.

A value's `$` opens LaTeX (`$x = 2$`) when a `$` closes it on the same line by Pandoc's
rule (a non-space character before the closing `$`, no digit after it); otherwise it is
a currency sign ("The answer is $1,234." is 1,234; "$5 or $6" offers two amounts).
Markdown emphasis around a value (`**$1,234**.`) is dropped, and so is the sentence's
full stop.

With no marker, `is_computation` and `last_result` keep a restated question from
counting as its own answer: "To calculate 6 + 6" states no answer (math-verify would
read the expression `6 + 6` and score it as 12), "12, since 6 + 6" answers 12.

`math_verifier.py` decides which marker counts; this module only finds them and cuts
the value out of a marker's text. The scanning is linear in the response's length;
math-verify's parsing of what it finds is not, which is why the service runs all of
it in a bounded worker (rewards/bounded.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Source = Literal["boxed", "####", "answer phrase"]

_BOXED = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")
# What a value starts with (after optional Markdown emphasis): a digit, a sign, `$`, a
# backslash, a bracket, a point, or a one-letter name (not a word).
_VALUE_START = r"(?=(?:\*{1,2}|_{1,2})?(?:[-+−$\\(\[{.\d]|[A-Za-z](?![A-Za-z])))"
_HASHES = re.compile(r"^[ \t]*####[ \t]*" + _VALUE_START + r"([^\n]*)", re.MULTILINE)
_PHRASE = re.compile(
    r"\banswer\b[ \t]*(?:\*\*[ \t]*)?(?:is\b|:|=)[ \t:]*(?:\*\*[ \t]*)?(?:either[ \t]+)?"
    + _VALUE_START
    + r"([^\n]*)",
    re.IGNORECASE,
)
# A word of three or more letters not introduced by a backslash: prose, not a value.
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
# "+7" is 7: a plus sign at the start, or after `=`, `(`, `:`, `$`, a comma or "is".
_PLUS = re.compile(
    r"(?:^|(?<=[=(\[{:$,])|(?<=[=(\[{:$,] )|(?<=\bis )|(?<=\bbe ))\+(?=\d)", re.MULTILINE
)
# Alternatives offered inside one final answer: "3 or 4", "3 \\text{ or } 4".
_OR = re.compile(r"\\text\{\s*or\s*\}|\bor\b", re.IGNORECASE)
_FILLER = re.compile(
    r"^(?:(?:either|maybe|perhaps|possibly|else|equivalently)\b[ \t,]*)+", re.IGNORECASE
)
_LAST_EQ = re.compile(r"(?<![\\<>!])=")
_ENVS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# The `$` that closes inline math (Pandoc's rule): a non-space character before it and no
# digit after it, so "$5 or $6" and "$20,000 and $30,000" are amounts, not math.
_DOLLAR_CLOSE = re.compile(r"(?<=\S)\$(?!\d)")
_OPEN, _CLOSE = "([{", ")]}"


# A computation of plain numbers not carried out: "6 + 6", "7*8", "(3 - 1) × 4", "6 \\div 2".
# Fractions ("3/4"), powers and anything with a name or a LaTeX command are values.
_NUM = r"\(*[-−]?\d+(?:[.,]\d+)*\)*"
_COMPUTATION = re.compile(rf"{_NUM}(?:[-+−*×÷]{_NUM})+")
_LATEX_OPS = (("\\times", "×"), ("\\cdot", "×"), ("\\div", "÷"))
# A number in running text (1,234 and 0.5 are one number each).
_NUMBER = re.compile(r"(?<![\d.,])[-−]?\d+(?:,\d{3})*(?:\.\d+)?(?![\d])")
# Operators that make a neighbouring number an operand, not a result.
_OPERATORS = "+-−*×÷/^"


@dataclass(frozen=True)
class Marker:
    """One explicit final-answer statement: where it starts (character offset in the
    response), what kind it is, and its text (boxed contents, or the rest of the line)."""

    start: int
    source: Source
    text: str


def strip_plus(text: str) -> str:
    """Drop explicit plus signs of numbers ("is +7" → "is 7"); "3 + 4" is untouched."""
    return _PLUS.sub("", text)


def _closers(text: str) -> dict[int, int]:
    """For every `{` of `text` that is closed, the index of its `}` (one pass; a
    backslash escapes the next character)."""
    found, stack, i = {}, [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            found[stack.pop()] = i
        i += 1
    return found


def find_markers(response: str) -> list[Marker]:
    """Every explicit final-answer marker of `response`, in order of position."""
    found, closers = [], _closers(response) if "\\" in response else {}
    for m in _BOXED.finditer(response):
        close = closers.get(m.end() - 1)
        if close is not None:
            found.append(Marker(m.start(), "boxed", response[m.end() : close]))
    found += [Marker(m.start(), "####", m.group(1)) for m in _HASHES.finditer(response)]
    found += [Marker(m.start(), "answer phrase", m.group(1)) for m in _PHRASE.finditer(response)]
    return sorted(found, key=lambda k: k.start)


def sentence(text: str) -> str:
    """`text` up to the end of its first sentence (". ", ";" or a newline, outside brackets)."""
    depth = 0
    for i, c in enumerate(text):
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth = max(0, depth - 1)
        elif depth == 0 and (c in ";\n" or (c == "." and not text[i + 1 : i + 2].isdigit())):
            return text[:i]
    return text


def _unwrap(text: str) -> str:
    """`text` without Markdown emphasis around it ("**$1,234**" → "$1,234"; `z^*` kept)."""
    s = text.strip().lstrip("*_").lstrip()
    t = s.rstrip("*_")
    return (s if t.endswith("^") else t).rstrip()


def leading_value(text: str) -> str:
    """The value a marker's text starts with: a whole `$...$`-style environment, or the
    text up to the sentence's end or its first prose word (two or more letters not
    introduced by a backslash), outside brackets, without Markdown emphasis.
    "1,234 dollars." → "1,234"; "$1,234." (a `$` nothing closes: currency) → "1,234";
    "**$7**." → "7"."""
    s = _unwrap(text)
    for left, right in _ENVS:
        if s.startswith(left):
            if left == "$":
                found = _DOLLAR_CLOSE.search(s, 1)
                if found is None:  # nothing closes it: a currency sign, not LaTeX
                    s = s[1:]
                    break
                return _unwrap(s[1 : found.start()])
            close = s.find(right, len(left))
            return _unwrap(s[len(left) : close] if close > 0 else s[len(left) :])
    s, depth = _unwrap(sentence(s)), 0
    for i, c in enumerate(s):
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth = max(0, depth - 1)
        elif (
            depth == 0
            and c.isspace()
            and re.match(r"[A-Za-z]{2}", s[i + 1 : i + 3])
            and s[i + 1 : i + 2] != "\\"
        ):
            return _unwrap(s[:i].rstrip(" ,"))
    return _unwrap(s.rstrip(" ,"))


def is_prose(value: str) -> bool:
    """True when a marker's value is words, not math: no digit, no backslash, and a word of
    three or more letters ("(verified)", "(see above)"); "x + y" and "2xy" are values."""
    return not re.search(r"[\d\\]", value) and _WORD.search(value) is not None


def last_side(value: str) -> str:
    """The right-hand side of an equation ("x = 5" → "5", "2+40=42" → "42"); values with
    a comma or semicolon (several assignments) are kept whole."""
    if "," in value or ";" in value:
        return value
    return _LAST_EQ.split(value)[-1].strip()


def alternatives(text: str) -> list[str]:
    """The parts of one final answer joined by "or" ("1234 or maybe 12" → two parts);
    a single part when there is no "or"."""
    parts = (_FILLER.sub("", s.strip(" ,()")) for s in _OR.split(text))
    return [p for p in parts if p]


def is_computation(value: str) -> bool:
    """True when `value` is plain numbers joined by + − * × ÷ (or LaTeX's \\times,
    \\cdot, \\div) and nothing else: a computation not carried out, such as the
    question restated ("6 + 6"). "-7", "3/4", "2^{10}", "x + 1" and "6 + 6 = 12" are not."""
    s = value
    for latex, op in _LATEX_OPS:
        s = s.replace(latex, op)
    s = re.sub(r"\s+", "", s)
    return _COMPUTATION.fullmatch(s) is not None


def last_result(response: str) -> str | None:
    """The last number of `response` that is not an operand of a computation (no
    operator right before or after it; one after `=` is a result), or None.
    "12, since 6 + 6" → "12"; "To calculate 6 + 6" → None; "6 + 6 = 12" → "12"."""
    for latex, op in _LATEX_OPS:
        response = response.replace(latex, op)
    found = None
    for m in _NUMBER.finditer(response):
        before = response[: m.start()].rstrip()[-1:]
        after = response[m.end() :].lstrip()[:1]
        if before and before in _OPERATORS and not m.group().startswith(("-", "−")):
            continue
        if after and after in _OPERATORS + "=":
            continue
        found = m.group()
    return found
