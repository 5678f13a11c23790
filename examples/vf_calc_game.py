"""An example verifiers environment, written to verifiers' public API (the classic
MultiTurnEnv of 0.1.9-0.3.x): arithmetic with a calculator tool, over several turns.

Each row asks for a sum (or product) of two whole numbers from 1 to `max_operand`. The
model may use the calculator by writing a line `calc: <expression>` (digits, + - * and
parentheses); the environment answers `result: <value>`. A turn that states an answer
ends the game; a turn with neither gets a reminder. Rubric: `correct` (1 when the stated
answer is right, weight 1) and `answered` (1 when there is a stated answer, weight 0.2),
so only a right answer reaches a reward of 1.

A stated answer (`stated_answer`) is what a small instruct model writes when asked: the
last `answer: N` / `answer is N` in the turn, else the last equation of the question's
own operands (`12 + 7 = 19`), else a turn that is only a number. One number is judged
per episode: a list of guesses is judged on its last.

Run it with posttrain (docs/multi-turn.md):

    rollout:
      max_turns: 2
      environment: {type: verifiers, module: vf_calc_game, args: {size: 200}}
    data:
      train: {environment: train}      # the environment's dataset

with this folder on PYTHONPATH and verifiers (< 0.4: 0.4 has only `verifiers.v1`)
installed. Also `vf.load_environment("vf-calc-game")` once installed as a package.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM = (
    "Reply with only the final number, as 'answer: <number>'. For a hard product you "
    "may first write 'calc: 12*34' and you will get 'result: 408'."
)
_CALC = re.compile(r"^calc:\s*([0-9+\-*() ]{1,60})\s*$", re.MULTILINE)
_ANSWER = re.compile(r"answer[^\w-]{0,4}(?:is[^\w-]{0,3})?(-?\d+)", re.IGNORECASE)
_QUESTION = re.compile(r"What is (\d+) ([+*]) (\d+)\?")
_ONLY_NUMBER = re.compile(r"[^\w-]{0,3}(-?\d+)\.?[^\w-]{0,3}")


def problems(size: int, eval_size: int, seed: int, max_operand: int,
             ops: str = "+*") -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Train and held-out rows `{question, answer, task}`, `a op b` with operands
    1..`max_operand` and op from `ops`: the held-out problems are `eval_size` distinct
    ones that no train row asks; the train rows are `size` draws from the rest.

    Raises:
        ValueError: `eval_size` leaves no problem to train on.
    """
    every = [(a, op, b) for op in ops for a in range(1, max_operand + 1)
             for b in range(1, max_operand + 1)]  # fmt: skip
    if eval_size >= len(every):
        raise ValueError(f"eval_size {eval_size} leaves none of the {len(every)} problems "
                         f"to train on; raise max_operand or lower eval_size")  # fmt: skip
    rng = random.Random(seed)
    rng.shuffle(every)
    held, rest = every[:eval_size], every[eval_size:]
    drawn = [rest[rng.randrange(len(rest))] for _ in range(size)]

    def row(a: int, op: str, b: int) -> dict:
        value = a + b if op == "+" else a * b
        return {"question": f"What is {a} {op} {b}?", "answer": str(value), "task": "calc"}

    return [row(*p) for p in drawn], [row(*p) for p in held]


def calculate(expression: str) -> str:
    """The calculator tool: an expression of integers, + - * and parentheses."""
    if not re.fullmatch(r"[0-9+\-*() ]+", expression) or "**" in expression:
        return "error: only integers, + - * and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}, {}))  # noqa: S307 - checked above
    except SyntaxError:
        return "error: not an expression"


def stated_answer(text: str, question: str) -> str | None:
    """The number a turn states as its answer (see the module docstring), or None."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1]
    q = _QUESTION.search(question)
    if q:
        a, op, b = q.groups()
        sign = r"\+" if op == "+" else r"[*x×]"
        pairs = f"(?:{a}\\s*{sign}\\s*{b}|{b}\\s*{sign}\\s*{a})"
        found = re.findall(pairs + r"\s*=\s*(-?\d+)", text)
        if found:
            return found[-1]
    only = _ONLY_NUMBER.fullmatch(text.strip())
    return only.group(1) if only else None


def _question(prompt: list) -> str:
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def _stated(prompt: list, completion: list) -> list[str]:
    q = _question(prompt)
    said = (stated_answer(t["content"], q) for t in completion if t["role"] == "assistant")
    return [s for s in said if s is not None]


class CalcGame(vf.MultiTurnEnv):
    """The game: tool calls answered in `env_response`, ends on a stated answer."""

    async def env_response(self, messages: list, state: dict, **kwargs) -> list:
        text = messages[-1]["content"]
        calls = _CALC.findall(text)
        if calls:
            state["tool_calls"] = state.get("tool_calls", 0) + 1
            return [{"role": "user", "content": f"result: {calculate(calls[-1])}"}]
        return [{"role": "user", "content": "Use 'calc: ...' or finish with 'answer: N'."}]

    @vf.stop
    async def gave_answer(self, state: dict) -> bool:
        if not state["responses"] or _CALC.search(state["responses"][-1]):
            return False
        return stated_answer(state["responses"][-1], _question(state["prompt"])) is not None


def correct(prompt: list, completion: list, answer: str) -> float:
    """1.0 when the last stated answer equals the reference."""
    said = _stated(prompt, completion)
    return 1.0 if said and said[-1] == answer else 0.0


def answered(prompt: list, completion: list) -> float:
    """1.0 when the model stated an answer at all."""
    return float(bool(_stated(prompt, completion)))


def load_environment(size: int = 200, eval_size: int = 50, seed: int = 0,
                     max_operand: int = 20, ops: str = "+*",
                     max_turns: int = 3) -> CalcGame:  # fmt: skip
    """The environment (verifiers' entry point): train rows and held-out eval rows that
    share no problem (`problems`)."""
    rubric = vf.Rubric(funcs=[correct, answered], weights=[1.0, 0.2])
    train, held = problems(size, eval_size, seed, max_operand, ops)
    return CalcGame(
        dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(held),
        system_prompt=SYSTEM,
        rubric=rubric,
        max_turns=max_turns,
    )
