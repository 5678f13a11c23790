"""A minimal local stand-in for Prime Intellect's `verifiers` (its classic MultiTurnEnv
API of 0.1.9-0.3.x: `Environment`, `MultiTurnEnv`, `Rubric`, `Parser`, `stop`,
`load_environment`), with the same public shape and none of its machinery (clients,
sampling, sandboxes). Tests put this folder on sys.path because the real package cannot
be installed beside posttrain's pins (0.3.0 would downgrade mcp and websockets; 0.4.0
has only `verifiers.v1` and would downgrade openai and mcp). Only what posttrain's adapter
calls is here; it is not a reimplementation. `verifiers.v1` (its stand-in: v1/) sits
beside it here, unlike in any real release."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.3.0+stand-in"


def stop(func: Any = None, *, priority: int = 0) -> Any:
    """Marks an async method `(state) -> bool` as a stop condition (`@vf.stop`)."""

    def mark(f: Any) -> Any:
        f.stop_priority = priority
        return f

    return mark(func) if func is not None else mark


class Parser:
    """Text parser; `parse_answer(completion)` is the last message's text, stripped."""

    def parse_answer(self, completion: Any) -> str | None:
        if isinstance(completion, list):
            texts = [m["content"] for m in completion if m.get("role") == "assistant"]
            return texts[-1].strip() if texts else None
        return str(completion).strip()


class Rubric:
    """Reward functions with weights and a parser."""

    def __init__(self, funcs: list[Any] | None = None, weights: list[float] | None = None,
                 parser: Parser | None = None) -> None:  # fmt: skip
        self.funcs = list(funcs or [])
        self.weights = list(weights or [1.0] * len(self.funcs))
        self.parser = parser or Parser()
        self.class_objects = {"parser": self.parser}


class Environment:
    """Dataset, system prompt, parser and rubric."""

    def __init__(self, dataset: Any = None, eval_dataset: Any = None,
                 system_prompt: str | None = None, parser: Parser | None = None,
                 rubric: Rubric | None = None, **kwargs: Any) -> None:  # fmt: skip
        self.dataset, self.eval_dataset = dataset, eval_dataset
        self.system_prompt = system_prompt
        self.parser = parser or Parser()
        self.rubric = rubric or Rubric(parser=self.parser)


class MultiTurnEnv(Environment):
    """`env_response` answers each model turn; `is_completed` checks the `@stop`
    conditions (and `max_turns`)."""

    def __init__(self, max_turns: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_turns = max_turns

    async def env_response(self, messages: list, state: dict, **kwargs: Any) -> list:
        raise NotImplementedError

    async def setup_state(self, state: dict) -> dict:
        return state

    @stop
    async def max_turns_reached(self, state: dict) -> bool:
        return 0 < self.max_turns <= len(state["trajectory"])

    async def is_completed(self, state: dict, **kwargs: Any) -> bool:
        conditions = [
            getattr(self, n) for n in dir(type(self))
            if hasattr(getattr(type(self), n), "stop_priority")
        ]  # fmt: skip
        for condition in sorted(conditions, key=lambda c: -c.stop_priority):
            if await condition(state):
                return True
        return False


def load_environment(env_id: str, **env_args: Any) -> Environment:
    """Imports module `env_id` (dashes as underscores) and calls its load_environment."""
    return importlib.import_module(env_id.replace("-", "_")).load_environment(**env_args)
