"""An example OpenEnv environment: the number-guessing game of `guess_env.py` served with
OpenEnv's wire protocol (`rollout.environment: {type: openenv, url:
"http://127.0.0.1:{port}", serve: {command: [python, examples/openenv_game.py, --port,
"{port}"]}, observation_key: feedback}`: the run starts and stops it; docs/multi-turn.md).

`GuessEnvironment` has the shape of an `openenv-core` environment: `reset(seed,
episode_id)` and `step(action)` return an observation (`prompt`, `feedback`, `done`,
`reward`), `state` gives `episode_id` and `step_count`. It is also an MCP environment
with one tool, `compare` (step actions `{"type": "list_tools"}` and `{"type":
"call_tool", "tool_name": "compare", "arguments": {"number": 40}}`; `mcp_tools: true`).
With `openenv-core` installed you could serve it with its `create_app`; `create_app()`
here serves the same protocol with FastAPI alone, so it runs on a fresh clone without Docker:

- WebSocket `/ws`, one session (one environment) per connection: `{"type": "reset" |
  "step" | "state" | "close", "data": {...}}` → `{"type": "observation", "data":
  {"observation": {...}, "reward", "done"}}` or `{"type": "state", "data": {...}}`;
  a failure → `{"type": "error", "data": {"message", "code"}}`;
- HTTP `POST /reset`, `POST /step` `{"action": {...}}` (one shared environment: HTTP
  has no sessions), `GET /state`, `GET /health`.

The secret number comes from the reset's `seed` (the same for a prompt's samples), in
[1, 100]. Run it: `python examples/openenv_game.py --port 9200`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

_NUMBER = re.compile(r"-?\d+")
PROMPT = "I am thinking of a number from 1 to 100. Guess it: answer with one number."
COMPARE = {
    "name": "compare",
    "description": "Says whether a number is smaller than, equal to or greater than the "
    "secret number; it does not count as a guess.",
    "input_schema": {
        "type": "object",
        "properties": {"number": {"type": "integer"}},
        "required": ["number"],
    },
}


class GuessEnvironment:
    """One game (an OpenEnv `Environment`): actions `{"message": str}`."""

    def __init__(self) -> None:
        self.secret, self.episode_id, self.step_count = 0, None, 0

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> dict[str, Any]:
        self.secret = (seed or 0) % 100 + 1
        self.episode_id, self.step_count = episode_id, 0
        # with `prompt: observation` the reset's feedback is the first user message (an
        # empty one left the model the system prompt alone); short, as the recipe's system
        # prompt states the game
        obs = {"prompt": PROMPT, "feedback": "Your first guess?"}
        return {"observation": obs, "reward": None, "done": False}

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        if action.get("type") in ("list_tools", "call_tool"):
            return self.mcp(action)
        message = action.get("message")
        if not isinstance(message, str):
            raise ValueError(f"action {action!r} has no text 'message'")
        self.step_count += 1
        found = _NUMBER.findall(message)
        if not found:
            feedback, reward, done = "Answer with one number.", 0.0, False
        elif int(found[-1]) == self.secret:
            feedback, reward, done = "Right!", 1.0, True
        else:
            hint = "higher" if int(found[-1]) < self.secret else "lower"
            feedback, reward, done = f"{found[-1]} is wrong: go {hint}.", 0.0, False
        obs = {"prompt": PROMPT, "feedback": feedback}
        return {"observation": obs, "reward": reward, "done": done}

    def mcp(self, action: dict[str, Any]) -> dict[str, Any]:
        """OpenEnv's MCP actions (an `MCPEnvironment`'s step): `list_tools`, and
        `call_tool` of its one tool, `compare`, which says how a number compares with
        the secret without using a guess (the answers serialised as openenv-core's
        `ListToolsObservation` and `CallToolObservation` with a FastMCP result)."""
        if action["type"] == "list_tools":
            return {"observation": {"tools": [COMPARE]}, "reward": None, "done": False}
        name, args = action.get("tool_name"), action.get("arguments") or {}
        obs: dict[str, Any] = {"tool_name": name, "result": None, "error": None}
        number = args.get("number")
        if name != "compare":
            obs["error"] = {"error_type": "tool_not_found", "message": f"no tool {name!r}"}
        elif not isinstance(number, int) or isinstance(number, bool):
            obs["error"] = {"error_type": "invalid_args", "message": "number: an integer"}
        else:
            word = "equal to" if number == self.secret else "smaller than"
            word = "greater than" if number > self.secret else word
            text = f"{number} is {word} the secret number."
            obs["result"] = {
                "content": [{"type": "text", "text": text, "annotations": None, "meta": None}],
                "structured_content": {"result": text},
                "meta": None,
                "data": text,
                "is_error": False,
            }
        return {"observation": obs, "reward": None, "done": False}

    @property
    def state(self) -> dict[str, Any]:
        return {"episode_id": self.episode_id, "step_count": self.step_count}


def _answer(env: GuessEnvironment, kind: str, data: dict[str, Any]) -> dict[str, Any]:
    if kind == "reset":
        got = env.reset(data.get("seed"), data.get("episode_id"))
        return {"type": "observation", "data": got}
    if kind == "step":
        return {"type": "observation", "data": env.step(data)}
    if kind == "state":
        return {"type": "state", "data": env.state}
    return {"type": "error", "data": {"message": f"unknown type {kind!r}", "code": "UNKNOWN_TYPE"}}


def create_app(make_env: Any = GuessEnvironment):
    """The server: a FastAPI app of OpenEnv's routes over `make_env()` environments."""
    app = FastAPI(title="guessing game (OpenEnv protocol)")
    shared = make_env()

    @app.websocket("/ws")
    async def session(ws: WebSocket) -> None:
        await ws.accept()
        env = make_env()
        try:
            while True:
                msg = json.loads(await ws.receive_text())
                if msg.get("type") == "close":
                    break
                try:
                    out = _answer(env, msg.get("type"), msg.get("data") or {})
                except (ValueError, TypeError, KeyError) as e:
                    out = {"type": "error", "data": {"message": str(e), "code": "EXECUTION_ERROR"}}
                await ws.send_text(json.dumps(out))
        except WebSocketDisconnect:
            return
        await ws.close()

    @app.post("/reset")
    def reset(body: dict[str, Any] | None = None) -> dict[str, Any]:
        return _answer(shared, "reset", body or {})["data"]

    @app.post("/step")
    def step(body: dict[str, Any]) -> dict[str, Any]:
        return _answer(shared, "step", body["action"])["data"]

    @app.get("/state")
    def state() -> dict[str, Any]:
        return shared.state

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "healthy"}

    return app


if __name__ == "__main__":
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9200)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port)
