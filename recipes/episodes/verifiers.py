"""A verifiers environment as posttrain episodes (`rollout.environment: {type:
verifiers}`): one `VerifiersEpisode` per episode runs the environment's own multi-turn
logic on posttrain's token-in-token-out turns, and its rubric scores the episode.

Per episode (the contract: recipes/data/environment.py):
- `reset`: the state verifiers keeps per rollout, `{prompt, completion, answer, task,
  info, trajectory, turn, responses, ...}`, through `setup_state(state)`; the model
  starts from the dataset row's prompt (the request's messages).
- `step(text)`: the model's turn is appended to `completion` and `trajectory`; when
  `is_completed` says so (or `state["final_env_response"]` is set) the episode ends,
  else `env_response(messages, state)` answers with messages.
- `finish(messages)`, once when the episode ended for any reason (done, `max_turns`,
  the token budget): each rubric function scores the rollout; the weighted sum is the
  episode's `environment` reward, each function's value a reward component named after
  it (in the rollout's reward details and the `reward/<name>` metrics).

Async methods run to completion on a fresh event loop per call (`asyncio.run`, on the
calling thread) under `timeout_s`; a call that raises, runs past it, or returns the
wrong types fails that episode only (multiturn.py). Limits: the deadline cannot
interrupt a coroutine that blocks without awaiting; an environment that keeps asyncio
objects (sessions, locks) across calls sees a different loop each call; the rubric's
class objects other than `parser` are passed as the rubric keeps them.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from ...actors.rollout import PromptRequest
from ...config.episodes import VerifiersEnvironment
from ...rewards.protocol import is_finite_number
from ..data.environment import load_verifiers, reward_functions
from .multiturn import StepResult


class VerifiersEpisode:
    """One episode of a verifiers environment (see the module docstring)."""

    def __init__(self, config: VerifiersEnvironment, episode_id: str):
        self.config, self.env = config, load_verifiers(config)
        self.source = f"verifiers {config.label} (episode {episode_id})"
        self.state: dict[str, Any] = {}

    def _run(self, fn: Any, **named: Any) -> Any:
        """`fn` called with the arguments it names of `named` (all of them when it takes
        **kwargs), awaited under the deadline when it is a coroutine."""
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            named = {k: v for k, v in named.items() if k in params}
        got = fn(**named)
        if inspect.isawaitable(got):
            got = asyncio.run(asyncio.wait_for(_awaited(got), self.config.timeout_s))
        return got

    def reset(self, request: PromptRequest) -> list[dict[str, str]]:
        meta = request.metadata
        prompt = [dict(m) for m in request.messages]
        self.state = {
            "prompt": prompt,
            "completion": [],
            "answer": request.ground_truth,
            "task": meta.get("task"),
            "info": meta.get("info") or {},
            "trajectory": [],
            "responses": [],
            "turn": 0,
            "is_completed": False,
            "is_truncated": False,
        }
        setup = getattr(self.env, "setup_state", None)
        if setup is not None:
            got = self._run(setup, state=self.state)
            if isinstance(got, dict):
                self.state = got
        return prompt

    def _messages(self) -> list[dict[str, str]]:
        return [*self.state["prompt"], *self.state["completion"]]

    def step(self, message: str) -> StepResult:
        st = self.state
        reply = {"role": "assistant", "content": message}
        st["trajectory"].append({"prompt": self._messages(), "completion": [reply]})
        st["completion"].append(reply)
        st["responses"].append(message)
        st["turn"] += 1
        messages = self._messages()
        if self._run(self.env.is_completed, messages=messages, state=st) is True:
            return StepResult(done=True)
        got = self._run(self.env.env_response, messages=messages, state=st)
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
            got, self.state = got[0], got[1]  # the pre-0.1.9 (messages, state) form
        new = [dict(m) for m in got]
        self.state["completion"].extend(new)
        done = self.state.get("final_env_response") is not None
        return StepResult(messages=[] if done else new, done=done)

    def finish(self, messages: list[dict[str, str]]) -> tuple[float, dict[str, float]]:
        """The rubric's score of the finished episode: (weighted sum, {function: value}).

        Raises:
            ValueError: a function gave a value that is not a finite number.
        """
        st = self.state
        last = messages[-1]
        if last["role"] == "assistant" and st["responses"][-1:] != [last["content"]]:
            st["completion"].append(dict(last))  # a turn cut by the budget: never stepped
            st["responses"].append(last["content"])
        parser = getattr(self.env, "parser", None) or getattr(self.env.rubric, "parser", None)
        objects = dict(getattr(self.env.rubric, "class_objects", None) or {})
        named = {
            **objects,
            "prompt": st["prompt"],
            "completion": st["completion"],
            "answer": st["answer"],
            "state": st,
            "task": st["task"],
            "info": st["info"],
            "parser": parser,
        }
        total, parts = 0.0, {}
        for func, weight in reward_functions(self.env, self.source):
            value = self._run(func, **named)
            value = float(value) if isinstance(value, bool) else value
            if not is_finite_number(value):
                raise ValueError(f"reward function {func.__name__} gave {value!r}")
            parts[func.__name__] = float(value)
            total += weight * float(value)
        return total, parts


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
