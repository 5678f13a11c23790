"""An example verifiers environment, written to verifiers' public API (the classic
MultiTurnEnv of 0.1.9-0.3.x): arithmetic with a calculator tool, over several turns.

Each row asks for a sum or product of two numbers. The model may use the calculator by
writing a line `calc: <expression>` (digits, + - * and parentheses); the environment
answers `result: <value>`. It ends the game with a line `answer: <number>`; a turn with
neither gets a reminder. Rubric: `correct` (1 when the answer is right, weight 1) and
`answered` (1 when there is an answer line, weight 0.2).

Run it with posttrain (docs/multi-turn.md):

    rollout:
      max_turns: 3
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
    "Solve the arithmetic problem. You may use a calculator: write a line "
    "'calc: 12*34' and you will get 'result: 408'. Finish with a line 'answer: <number>'."
)
_CALC = re.compile(r"^calc:\s*([0-9+\-*() ]{1,60})\s*$", re.MULTILINE)
_ANSWER = re.compile(r"answer:\s*(-?\d+)")


def problems(size: int, seed: int, digits: int) -> list[dict]:
    """Rows `{question, answer, task}`: `a op b` with operands of up to `digits` digits."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(1, 10**digits - 1), rng.randint(1, 10**digits - 1)
        op = rng.choice("+*")
        value = a + b if op == "+" else a * b
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(value), "task": "calc"})
    return rows


def calculate(expression: str) -> str:
    """The calculator tool: an expression of integers, + - * and parentheses."""
    if not re.fullmatch(r"[0-9+\-*() ]+", expression) or "**" in expression:
        return "error: only integers, + - * and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}, {}))  # noqa: S307 - checked above
    except SyntaxError:
        return "error: not an expression"


class CalcGame(vf.MultiTurnEnv):
    """The game: tool calls answered in `env_response`, ends on an answer line."""

    async def env_response(self, messages: list, state: dict, **kwargs) -> list:
        text = messages[-1]["content"]
        calls = _CALC.findall(text)
        if calls:
            state["tool_calls"] = state.get("tool_calls", 0) + 1
            return [{"role": "user", "content": f"result: {calculate(calls[-1])}"}]
        return [{"role": "user", "content": "Use 'calc: ...' or finish with 'answer: N'."}]

    @vf.stop
    async def gave_answer(self, state: dict) -> bool:
        return bool(state["responses"]) and bool(_ANSWER.search(state["responses"][-1]))


def correct(completion: list, answer: str) -> float:
    """1.0 when the last answer line equals the reference."""
    found = [
        m for t in completion if t["role"] == "assistant" for m in _ANSWER.findall(t["content"])
    ]
    return 1.0 if found and found[-1] == answer else 0.0


def answered(completion: list) -> float:
    """1.0 when the model gave an answer line at all."""
    return float(any(_ANSWER.search(t["content"]) for t in completion if t["role"] == "assistant"))


def load_environment(size: int = 200, eval_size: int = 50, seed: int = 0, digits: int = 2,
                     max_turns: int = 3) -> CalcGame:  # fmt: skip
    """The environment (verifiers' entry point): train and eval rows from disjoint seeds."""
    rubric = vf.Rubric(funcs=[correct, answered], weights=[1.0, 0.2])
    return CalcGame(
        dataset=Dataset.from_list(problems(size, seed, digits)),
        eval_dataset=Dataset.from_list(problems(eval_size, seed + 1_000_003, digits)),
        system_prompt=SYSTEM,
        rubric=rubric,
        max_turns=max_turns,
    )
