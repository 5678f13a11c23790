"""An example user environment: a number-guessing game, in both forms.

Each episode hides a number in [1, 100] (from the item's `ground_truth` when it is an
integer, else from the episode id). The model answers a number each turn; the game
replies "higher" or "lower" and ends with reward 1 on the right guess; a turn without a
number gets a reminder. Reward 0 until then (episodes cut by `rollout.max_turns` score
only the reward components).

Python-class form (`rollout.environment: {type: python, class_path:
"guess_env:GuessingGame"}`, this folder on PYTHONPATH): `GuessingGame`.

HTTP form (`{type: http, url: "http://127.0.0.1:9100"}`): `create_app()` serves
`POST /reset` and `POST /step` (README, "Multi-turn and tools") and `GET /health`; run it
with `python examples/guess_env.py --port 9100` (token from $GUESS_ENV_TOKEN, if set), or
let the run start it: `url: "http://127.0.0.1:{port}"`, `serve: {command: [python,
examples/guess_env.py, --port, "{port}"]}`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def secret_for(ground_truth: str, episode_id: str) -> int:
    """The hidden number: `ground_truth` if it is an integer in [1, 100], else a hash of
    the episode id."""
    if ground_truth.strip().isdigit() and 1 <= int(ground_truth) <= 100:
        return int(ground_truth)
    return int(hashlib.sha256(episode_id.encode()).hexdigest(), 16) % 100 + 1


def answer(secret: int, message: str) -> dict[str, Any]:
    """The game's reply to one model turn, as a `/step` response."""
    found = _NUMBER.findall(message)
    if not found:
        return {
            "messages": [{"role": "user", "content": "Answer with one number."}],
            "reward": 0.0,
            "done": False,
        }
    guess = int(found[-1])
    if guess == secret:
        return {"messages": [], "reward": 1.0, "done": True}
    hint = "higher" if guess < secret else "lower"
    return {
        "messages": [{"role": "user", "content": f"{guess} is wrong: go {hint}."}],
        "reward": 0.0,
        "done": False,
    }


class GuessingGame:
    """Python-class form: one instance per episode."""

    def __init__(self) -> None:
        self.secret = 0

    def reset(self, request: Any) -> list[dict[str, str]]:
        self.secret = secret_for(request.ground_truth, request.group_id)
        return list(request.messages)

    def step(self, message: str) -> dict[str, Any]:
        return answer(self.secret, message)


def create_app(token: str | None = None):
    """The HTTP form: a FastAPI app keeping each episode's number under its id."""
    from fastapi import FastAPI, Header, HTTPException

    app = FastAPI(title="guessing game environment")
    secrets: dict[str, int] = {}

    def auth(authorization: str | None) -> None:
        if token and authorization != f"Bearer {token}":
            raise HTTPException(401, "bad or missing bearer token")

    @app.post("/reset")
    def reset(body: dict[str, Any], authorization: str | None = Header(None)) -> dict[str, Any]:
        auth(authorization)
        item = body["item"]
        secrets[body["episode_id"]] = secret_for(
            str(item.get("ground_truth", "")), body["episode_id"]
        )
        return {"messages": item["messages"]}

    @app.post("/step")
    def step(body: dict[str, Any], authorization: str | None = Header(None)) -> dict[str, Any]:
        auth(authorization)
        if body["episode_id"] not in secrets:
            raise HTTPException(404, f"unknown episode {body['episode_id']!r}; POST /reset first")
        out = answer(secrets[body["episode_id"]], body["message"]["content"])
        if out["done"]:
            secrets.pop(body["episode_id"])
        return out

    @app.get("/health")
    def health() -> dict[str, str]:  # no token: says only that the server is up
        return {"status": "healthy"}

    return app


if __name__ == "__main__":
    import argparse
    import os

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9100)
    args = parser.parse_args()
    uvicorn.run(create_app(os.environ.get("GUESS_ENV_TOKEN")), host="127.0.0.1", port=args.port)
