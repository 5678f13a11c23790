"""A client of OpenEnv environment servers (`rollout.environment: {type: openenv}`), one
per episode, speaking the wire protocol of Meta's `openenv-core` (its `EnvClient` and
`HTTPEnvServer`), written against that documented protocol: no OpenEnv package is needed.

WebSocket transport (`transport: websocket`, the default; OpenEnv's stateful one): one
connection to `{url}/ws` per episode (a server session), JSON text messages:

- `{"type": "reset", "data": {"episode_id", "seed", **reset_args}}` and
  `{"type": "step", "data": {action_key: text, **action_args}}` → `{"type":
  "observation", "data": {"observation": {...}, "reward": float | null, "done": bool}}`;
- `{"type": "state"}` → `{"type": "state", "data": {...}}`; `{"type": "close"}` ends the
  session; a failing call → `{"type": "error", "data": {"message", "code"}}`.

HTTP transport (`transport: http`): `POST {url}/reset` with the reset data, `POST
{url}/step` `{"action": {...}}` (same answers, without the envelope), `GET {url}/state`.
OpenEnv's own server builds a fresh environment for every HTTP request, so this suits
only servers that keep their state themselves.

The model's turn text becomes the action field `action_key`; the observation's field
`observation_key` (a string), or the whole observation as sorted JSON, becomes one
`message_role` message. `seed` is a hash of the episode's group id (the GRPO group: all
samples of a prompt get the same seed), below 2**31, the same at every evaluation.

Rules (as for `type: http`, recipes/episodes/environments.py): each request or message
has the deadline `timeout_s` (a server that drips its answer is cut); connecting and the
HTTP requests are retried `retries` times with backoff; a WebSocket that closes or fails
mid-episode is not retried (the server's session, the episode's state, is gone); an
answer over `max_message_bytes`, an `error` answer, an answer of the wrong shape fail
the episode (`EnvironmentFailed`), as does a non-finite reward (multiturn.py). The other
episodes go on.

With `mcp_tools: true` the server's MCP tools are listed at reset and called through
`step` (recipes/episodes/openenv_mcp.py). Not supported: OpenEnv's direct MCP routes
(`/mcp`, `{"type": "mcp"}` JSON-RPC: no rewards there), images or other
non-text observations (give `observation_key` of a text field), and Docker or Hub
launching (a Python server such as `examples/openenv_game.py` is started for the run by
`rollout.environment.serve`: recipes/roles/env_server.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

from pydantic import BaseModel, ValidationError

from ...actors.rollout import PromptRequest
from ...common.http import DeadlineClient
from ...config.episodes import OpenEnvEnvironment
from .multiturn import StepResult
from .openenv_mcp import McpTool, parse_tools, result_text, with_tools
from .remote import EnvironmentFailed, bearer_headers, request_json
from .tools import ToolCallError, parse_tool_calls, run_tool_calls


class OpenEnvResult(BaseModel):
    """A reset or step answer (environment → controller): OpenEnv's `StepResponse`."""

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False


def episode_seed(group_id: str) -> int:
    """The reset `seed` of a group's episodes: sha256 of the group id without its step
    or policy version (`s12-p3-1` → `s-p3-1`), mod 2**31, so that every evaluation
    (`e{version}-p{prompt}-{i}`) plays the same games and before/after compare."""
    key = re.sub(r"^([a-z]+)\d+", r"\1", group_id)
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 2**31


class OpenEnvClient:
    """One episode's session with an OpenEnv server (see the module docstring).

    Concurrency: one instance per episode; `reset`, `step`, `state`, `close` are called
    from one thread at a time (run_episodes' pool steps each episode on one thread).
    """

    def __init__(self, config: OpenEnvEnvironment, episode_id: str, backoff_s: float = 0.5):
        self.config, self.episode_id, self.backoff_s = config, episode_id, backoff_s
        self.source = f"openenv {config.url} (episode {episode_id})"
        self.headers = bearer_headers(config)
        self.base = config.url.rstrip("/")
        self.http = DeadlineClient(config.timeout_s, self.headers)
        self.ws: Any = None
        self.tools: dict[str, McpTool] = {}  # listed at reset with mcp_tools

    # --- transport ---------------------------------------------------------------------

    def _connect(self) -> Any:
        """Open `{url}/ws` (http → ws), retried with backoff."""
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect

        url = "ws" + self.base[4:] if self.base.startswith("http") else self.base
        last = ""
        for attempt in range(self.config.retries + 1):
            try:
                return connect(
                    f"{url}/ws",
                    open_timeout=self.config.timeout_s,
                    close_timeout=1,
                    max_size=self.config.max_message_bytes,
                    additional_headers=self.headers,
                )
            except (OSError, TimeoutError, WebSocketException) as e:
                last = f"{type(e).__name__}: {e}"
                if attempt < self.config.retries:
                    time.sleep(self.backoff_s * 2**attempt)
        raise EnvironmentFailed(f"openenv {url}/ws: cannot connect for {self.episode_id}: {last}")

    def _ws_call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message, return the answer's `data`; `type: error` or any transport
        failure raises."""
        from websockets.exceptions import WebSocketException

        if self.ws is None:
            self.ws = self._connect()
        try:
            self.ws.send(json.dumps(message))
            raw = self.ws.recv(timeout=self.config.timeout_s)
        except TimeoutError:
            raise EnvironmentFailed(
                f"{self.source}: no answer to {message['type']} within "
                f"{self.config.timeout_s:g} s (timeout_s)"
            ) from None
        except WebSocketException as e:
            raise EnvironmentFailed(
                f"{self.source}: the connection failed at {message['type']}: "
                f"{type(e).__name__}: {e}"
            ) from e
        answer = json.loads(raw)
        if not isinstance(answer, dict) or not isinstance(answer.get("data"), dict):
            raise EnvironmentFailed(f"{self.source}: answer {raw!r:.200} has no data object")
        if answer.get("type") == "error":
            raise EnvironmentFailed(f"{self.source}: {message['type']} failed: {answer['data']}")
        return answer["data"]

    def _call(self, kind: str, data: dict[str, Any]) -> OpenEnvResult:
        """A reset or step through the configured transport, validated."""
        if self.config.transport == "http":
            body = data if kind == "reset" else {"action": data}
            url, who = f"{self.base}/{kind}", f"episode {self.episode_id}"
            return request_json(
                self.http, self.config, "POST", url, body, OpenEnvResult, who, self.backoff_s
            )
        got = self._ws_call({"type": kind, "data": data})
        try:
            return OpenEnvResult.model_validate(got)
        except ValidationError as e:
            raise EnvironmentFailed(f"{self.source}: {kind} answered {got!r:.200}: {e}") from e

    # --- the Environment protocol --------------------------------------------------------

    def _text(self, observation: dict[str, Any]) -> str:
        key = self.config.observation_key
        if key is None:
            return json.dumps(observation, sort_keys=True)
        value = observation.get(key)
        if not isinstance(value, str):
            raise EnvironmentFailed(
                f"{self.source}: observation field {key!r} is {value!r:.100}, not text; "
                f"set rollout.environment.observation_key to one of {sorted(observation)}"
            )
        return value

    def reset(self, request: PromptRequest) -> list[dict[str, str]]:
        data = {
            "episode_id": self.episode_id,
            "seed": episode_seed(request.group_id),
            **self.config.reset_args,
        }
        got = self._call("reset", data)
        if self.config.prompt == "item":
            messages = list(request.messages)
        else:
            system = [m for m in request.messages if m["role"] == "system"]
            messages = [*system, {"role": "user", "content": self._text(got.observation)}]
        if self.config.mcp_tools:
            listed = self._call("step", {"type": "list_tools"})
            self.tools = parse_tools(listed.observation, self.source)
            messages = with_tools(messages, self.tools)
        return messages

    def _call_tools(self, calls: list[dict[str, Any] | ToolCallError]) -> StepResult:
        """A turn's MCP tool calls, one `call_tool` step each, in order; rewards summed,
        done when one says so (the calls after it are not made)."""

        def call_one(name: str, arguments: Any, res: StepResult) -> tuple[str, bool]:
            action = {"type": "call_tool", "tool_name": name, "arguments": arguments}
            got = self._call("step", action)
            if got.reward is not None:
                res.reward = got.reward + (res.reward or 0.0)
            res.done = got.done
            return result_text(got.observation, self.source)

        return run_tool_calls(calls, self.tools, call_one)

    def step(self, message: str) -> StepResult:
        if self.config.mcp_tools and (calls := parse_tool_calls(message)):
            return self._call_tools(calls)
        got = self._call("step", {self.config.action_key: message, **self.config.action_args})
        text = self._text(got.observation)
        msgs = [] if got.done else [{"role": self.config.message_role, "content": text}]
        return StepResult(messages=msgs, reward=got.reward, done=got.done)

    def state(self) -> dict[str, Any]:
        """The server's state of this episode (`episode_id`, `step_count`, ...)."""
        if self.config.transport == "http":
            resp = self.http.get(f"{self.base}/state")
            resp.raise_for_status()
            return resp.json()
        return self._ws_call({"type": "state"})

    def close(self) -> None:
        """End the session (idempotent; a server already gone is fine)."""
        from websockets.exceptions import WebSocketException

        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                ws.send(json.dumps({"type": "close"}))
            except (OSError, WebSocketException):
                pass  # the server closed first: nothing to end
            ws.close()
        self.http.close()
