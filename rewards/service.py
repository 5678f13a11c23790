"""The reward service: a FastAPI app serving `POST /score` and `GET /health`.

Built-ins: `math` (see math_verifier) and `length` (closeness to a target length).
One service hosts every built-in component of a recipe's `rewards:` list; an item's
reward is the weighted sum of its components, each reported in `details`. A
component that raises marks that item as failed (`reward: null`, `error` set); the
other items of the batch are still scored.

Started by the controller as a child process on 127.0.0.1 (`python -m
rewards.service`), or by hand on another host. When a bearer token is configured,
requests without it get 401.

Limits: the built-in verifiers run in this process, unsandboxed; they parse text and
never execute it.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException

from rewards.math_verifier import score_math
from rewards.protocol import Score, ScoreItem, ScoreRequest, ScoreResponse

log = logging.getLogger("posttrain.rewards")

def score_length(response: str, target_chars: int) -> tuple[float, dict[str, Any]]:
    """1 at exactly `target_chars` characters, falling linearly to 0 at 0 or 2× target."""
    n = len(response)
    return max(0.0, 1.0 - abs(n - target_chars) / target_chars), {"chars": n}


VERIFIERS: dict[str, Callable[[ScoreItem, dict[str, Any]], tuple[float, dict[str, Any]]]] = {
    "math": lambda item, comp: score_math(item.response, item.ground_truth),
    "length": lambda item, comp: score_length(item.response, comp["target_chars"]),
}


def _score_item(item: ScoreItem, components: list[dict[str, Any]]) -> Score:
    total, details = 0.0, {}
    for comp in components:
        try:
            value, extra = VERIFIERS[comp["type"]](item, comp)
        except Exception as e:  # a verifier bug must fail this item, not the batch
            log.warning("reward %s failed on %s: %s", comp["name"], item.uid, e)
            return Score(uid=item.uid, reward=None, error=f"{comp['name']}: {e}", details=details)
        details[comp["name"]] = value
        details.update({f"{comp['name']}.{k}": v for k, v in extra.items()})
        total += comp["weight"] * value
    return Score(uid=item.uid, reward=total, details=details)


def create_app(components: list[dict[str, Any]], token: str | None = None) -> FastAPI:
    """The service for `components` (each `{"name", "type", "weight"}`).

    Raises:
        ValueError: a component type with no built-in verifier.
    """
    for comp in components:
        if comp["type"] not in VERIFIERS:
            raise ValueError(
                f"reward {comp['name']!r}: type {comp['type']!r} has no verifier; "
                f"use one of {sorted(VERIFIERS)}"
            )
    app = FastAPI(title="posttrain reward service")

    def auth(authorization: str | None = Header(None)) -> None:
        if token and authorization != f"Bearer {token}":
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "components": [c["name"] for c in components]}

    @app.post("/score", dependencies=[Depends(auth)])
    def score(req: ScoreRequest) -> ScoreResponse:
        uids = [i.uid for i in req.items]
        if len(set(uids)) != len(uids):
            raise HTTPException(status_code=422, detail="uids in one request must be unique")
        return ScoreResponse(scores=[_score_item(i, components) for i in req.items])

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="posttrain reward service")
    ap.add_argument("--components", required=True, help="JSON list of {name, type, weight}")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-env", default="POSTTRAIN_REWARD_TOKEN",
                    help="environment variable holding the bearer token (unset: no auth)")
    args = ap.parse_args()
    import os

    app = create_app(json.loads(args.components), os.environ.get(args.token_env))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
