"""Users' environments (`rollout.environment`): over HTTP, or a Python class.

HTTP protocol (controller → environment; JSON; `Authorization: Bearer <token>` when
`token_env` is set):

- `POST {url}/reset` `{"episode_id": str, "item": {"messages": [...], "ground_truth":
  str, "metadata": {...}}}` → `{"messages": [{"role", "content"}, ...]}`: the
  conversation the model starts from (usually the item's messages, maybe with a system
  message or a first observation).
- `POST {url}/step` `{"episode_id": str, "message": {"role": "assistant", "content":
  str}}` → `{"messages": [...], "reward": float | null, "done": bool}`: the environment's
  answer to one model turn. Rewards of an episode are summed and added to the reward
  components' sum as the `environment` component.

Episode ids are unique per run (`{uid}@{step}`); an environment keeps its per-episode
state under them. Failures: a request that fails (connection error, timeout, 5xx, 408,
429, a malformed body) is retried with exponential backoff like the reward client;
another 4xx is not, nor an answer over `max_message_bytes`. `timeout_s` bounds each
whole request, however slowly the environment sends its answer (common/http.py). After
the last try `EnvironmentFailed` fails that episode only: its sample keeps what was
sampled and its score fails with the error (recipes/episodes/multiturn.py), as do a step
reward that is not a finite number (`NaN`, `Infinity`, `1e400`), a first prompt too long
for the engine, and an answer of the wrong shape.

OpenEnv servers (`type: openenv`): recipes/episodes/openenv.py, on the same rules.

The Python form: `class_path: "module:Class"`; `Class()` is built per episode and must
have `reset(request: PromptRequest) -> list[message]` and `step(message: str) ->
StepResult | dict` (the dict as the `/step` response above).
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ValidationError

from ...actors.rollout import PromptRequest
from ...common.http import DeadlineClient
from ...config.episodes import (
    HttpEnvironment,
    OpenEnvEnvironment,
    PythonEnvironment,
    VerifiersEnvironment,
)
from .multiturn import StepResult
from .remote import EnvironmentFailed, bearer_headers, request_json

__all__ = [
    "EnvironmentFailed",
    "HttpEnvironmentClient",
    "PythonEnvironmentAdapter",
    "make_environment",
]


class _Message(BaseModel):
    role: str
    content: str


class ResetResponse(BaseModel):
    """`POST /reset` response."""

    messages: list[_Message]


class StepResponse(BaseModel):
    """`POST /step` response."""

    messages: list[_Message] = []
    reward: float | None = None
    done: bool = False


class HttpEnvironmentClient:
    """One episode's view of an HTTP environment (see the module docstring)."""

    def __init__(self, config: HttpEnvironment, episode_id: str, backoff_s: float = 0.5):
        self.config, self.episode_id, self.backoff_s = config, episode_id, backoff_s
        self.source = f"environment {config.url} (episode {episode_id})"
        self.http = DeadlineClient(config.timeout_s, bearer_headers(config))

    def _post(self, route: str, body: dict[str, Any], model: type[BaseModel]) -> Any:
        url = f"{self.config.url.rstrip('/')}/{route}"
        who = f"episode {self.episode_id}"
        return request_json(self.http, self.config, "POST", url, body, model, who, self.backoff_s)

    def reset(self, request: PromptRequest) -> list[dict[str, str]]:
        item = {
            "messages": request.messages,
            "ground_truth": request.ground_truth,
            "metadata": request.metadata,
        }
        got = self._post("reset", {"episode_id": self.episode_id, "item": item}, ResetResponse)
        return [m.model_dump() for m in got.messages]

    def step(self, message: str) -> StepResult:
        body = {"episode_id": self.episode_id, "message": {"role": "assistant", "content": message}}
        got = self._post("step", body, StepResponse)
        return StepResult(
            messages=[m.model_dump() for m in got.messages], reward=got.reward, done=got.done
        )

    def close(self) -> None:
        self.http.close()


class PythonEnvironmentAdapter:
    """Wraps a user's class instance; accepts a `StepResult` or a `/step`-shaped dict."""

    def __init__(self, config: PythonEnvironment):
        module, _, name = config.class_path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise EnvironmentFailed(
                f"rollout.environment.class_path {config.class_path!r} "
                f"cannot be imported ({e}); give 'module:Class'"
            ) from e
        self.env = cls()
        self.source = f"environment {config.class_path}"

    def reset(self, request: PromptRequest) -> list[dict[str, str]]:
        return list(self.env.reset(request))

    def step(self, message: str) -> StepResult:
        got = self.env.step(message)
        if isinstance(got, StepResult):
            return got
        try:
            parsed = StepResponse.model_validate(got)
        except ValidationError as e:
            raise EnvironmentFailed(
                f"{type(self.env).__name__}.step returned {got!r}, not "
                f"{{messages, reward, done}}: {e}"
            ) from e
        return StepResult(
            messages=[m.model_dump() for m in parsed.messages],
            reward=parsed.reward,
            done=parsed.done,
        )


def make_environment(config: Any, episode_id: str) -> Any:
    """One episode's environment for the recipe's `rollout.environment`."""
    if isinstance(config, HttpEnvironment):
        return HttpEnvironmentClient(config, episode_id)
    if isinstance(config, OpenEnvEnvironment):
        from .openenv import OpenEnvClient

        return OpenEnvClient(config, episode_id)
    if isinstance(config, VerifiersEnvironment):
        from .verifiers import VerifiersEpisode

        return VerifiersEpisode(config, episode_id)
    return PythonEnvironmentAdapter(config)
