"""`generator: python_functions`: short Python functions to write, in HumanEval's layout.

Each problem is a function signature with a docstring (what to return and one worked
example), e.g.

    def add_7(x: int) -> int:
        \"\"\"Return x plus 7.
        >>> add_7(3)
        10
        \"\"\"

and the metadata the built-in `code` reward runs (rewards/code_verifier.py): `code_prefix`
(the signature and docstring the completion continues), `test` (a `check(candidate)`
with five asserts) and `entry_point` (the function's name). A reply with the body, or with
the whole function, passes when the five asserts do.

A problem is one template (`TEMPLATES`) and one parameter; its text, example and tests
depend on nothing else, so the same function always has the same prompt and a held-out
set made with another seed is kept out of training by the loader's rule for prompts
equal to evaluation prompts. There are `len(problem_space())` distinct problems; a
`size` above that repeats them.

Why: SmolLM2-135M passes almost none of HumanEval, so GRPO on it has no signal; these
problems sit where a small model passes some and can learn more (the grpo_code recipe).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORDS = ("cat", "sun", "tree", "blue", "rock", "fish", "moon", "star", "leaf", "wind")
LETTERS = ("a", "e", "i", "o", "s", "t", "n", "r")


def _int(r: random.Random) -> tuple[Any, ...]:
    return (r.randint(-20, 40),)


def _small(r: random.Random) -> tuple[Any, ...]:
    return (r.randint(-6, 6),)


def _natural(r: random.Random) -> tuple[Any, ...]:
    return (r.randint(0, 60),)


def _word(r: random.Random) -> tuple[Any, ...]:
    return ("".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 7))),)


def _ints(r: random.Random) -> tuple[Any, ...]:
    return ([r.randint(-9, 30) for _ in range(r.randint(1, 6))],)


def _pair(r: random.Random) -> tuple[Any, ...]:
    return (r.randint(-20, 40), r.randint(-20, 40))


@dataclass(frozen=True)
class Template:
    """One kind of function: `stem` names it (`{stem}_{param}`), `signature` is its
    arguments and return type, `doc` says what it returns (`{p}` is the parameter),
    `ref(p, *args)` is the reference solution, `params` the parameters drawn from and
    `inputs` one seeded argument tuple."""

    stem: str
    signature: str
    doc: str
    ref: Callable[..., Any]
    params: tuple[Any, ...]
    inputs: Callable[[random.Random], tuple[Any, ...]]


_N = tuple(range(2, 31))
TEMPLATES: tuple[Template, ...] = (
    Template("add", "(x: int) -> int", "Return x plus {p}.", lambda p, x: x + p, _N, _int),
    Template("subtract", "(x: int) -> int", "Return x minus {p}.", lambda p, x: x - p, _N, _int),
    Template(
        "times", "(x: int) -> int", "Return x multiplied by {p}.", lambda p, x: x * p, _N, _int
    ),
    Template(
        "is_multiple_of",
        "(x: int) -> bool",
        "Return True if x is divisible by {p}, else False.",
        lambda p, x: x % p == 0,
        _N,
        _natural,
    ),
    Template(
        "is_above",
        "(x: int) -> bool",
        "Return True if x is greater than {p}, else False.",
        lambda p, x: x > p,
        _N,
        _int,
    ),
    Template(
        "remainder",
        "(x: int) -> int",
        "Return the remainder of x divided by {p}.",
        lambda p, x: x % p,
        _N,
        _natural,
    ),
    Template(
        "at_most", "(x: int) -> int", "Return x, but at most {p}.", lambda p, x: min(x, p), _N, _int
    ),
    Template(
        "power",
        "(x: int) -> int",
        "Return x to the power of {p}.",
        lambda p, x: x**p,
        (2, 3, 4),
        _small,
    ),
    Template(
        "repeat",
        "(s: str) -> str",
        "Return the string s repeated {p} times.",
        lambda p, s: s * p,
        tuple(range(2, 7)),
        _word,
    ),
    Template(
        "first",
        "(s: str) -> str",
        "Return the first {p} characters of s.",
        lambda p, s: s[:p],
        tuple(range(1, 6)),
        _word,
    ),
    Template(
        "with_suffix",
        "(s: str) -> str",
        'Return s followed by "{p}".',
        lambda p, s: s + p,
        WORDS,
        _word,
    ),
    Template(
        "count",
        "(s: str) -> int",
        'Return how many times the letter "{p}" occurs in s.',
        lambda p, s: s.count(p),
        LETTERS,
        _word,
    ),
    Template(
        "sum_plus",
        "(xs: list[int]) -> int",
        "Return the sum of the numbers in xs plus {p}.",
        lambda p, xs: sum(xs) + p,
        _N,
        _ints,
    ),
    Template(
        "scale",
        "(xs: list[int]) -> list[int]",
        "Return a list of the numbers in xs, each multiplied by {p}.",
        lambda p, xs: [x * p for x in xs],
        _N,
        _ints,
    ),
    Template(
        "keep_above",
        "(xs: list[int]) -> list[int]",
        "Return the numbers in xs that are greater than {p}, in their order.",
        lambda p, xs: [x for x in xs if x > p],
        _N,
        _ints,
    ),
    Template(
        "count_above",
        "(xs: list[int]) -> int",
        "Return how many numbers in xs are greater than {p}.",
        lambda p, xs: sum(1 for x in xs if x > p),
        _N,
        _ints,
    ),
    Template(
        "max_plus",
        "(xs: list[int]) -> int",
        "Return the largest number in xs plus {p}.",
        lambda p, xs: max(xs) + p,
        _N,
        _ints,
    ),
    Template(
        "sum_times",
        "(a: int, b: int) -> int",
        "Return the sum of a and b, multiplied by {p}.",
        lambda p, a, b: (a + b) * p,
        _N,
        _pair,
    ),
)


def problem_space() -> list[tuple[Template, Any]]:
    """Every distinct problem: each template with each of its parameters, in order."""
    return [(t, p) for t in TEMPLATES for p in t.params]


def problem(t: Template, p: Any) -> dict[str, Any]:
    """The problem of template `t` with parameter `p`: `name`, `prompt` (= `code_prefix`),
    `test`, `entry_point`. Its example and five test inputs are seeded by the name alone."""
    name = f"{t.stem}_{p}"

    def fn(*args: Any) -> Any:
        return t.ref(p, *args)

    r = random.Random(name)
    cases = [t.inputs(r) for _ in range(6)]
    example, tests = cases[0], cases[1:]

    def call(args: tuple[Any, ...]) -> str:
        return f"{name}({', '.join(map(repr, args))})"

    prefix = (
        f"def {name}{t.signature}:\n"
        f'    """{t.doc.format(p=p)}\n'
        f"    >>> {call(example)}\n"
        f"    {fn(*example)!r}\n"
        f'    """\n'
    )
    asserts = "".join(
        f"    assert candidate({', '.join(map(repr, a))}) == {fn(*a)!r}\n" for a in tests
    )
    return {
        "name": name,
        "prompt": prefix,
        "code_prefix": prefix,
        "test": f"def check(candidate):\n{asserts}",
        "entry_point": name,
    }


def python_functions(size: int, seed: int) -> list[dict[str, Any]]:
    """`size` problems drawn without repeats (in a seeded order) from the problem space,
    cycling through it again when `size` is larger."""
    space = problem_space()
    order = list(range(len(space)))
    random.Random(seed).shuffle(order)
    return [problem(*space[order[i % len(order)]]) for i in range(size)]
