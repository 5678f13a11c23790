"""The reward service: a FastAPI app serving `POST /score`, `GET /health`, Prometheus
`GET /metrics` and its OpenAPI schema at `/docs` and `/openapi.json`.

One service hosts the local components of a recipe's `rewards:` list (`math`,
`length`, `format`, `code`, `python`); an item's reward is the weighted sum of its
components, each reported in `details`. A component that raises marks that item as
failed (`reward: null`, `error` set); the other items of the batch are still scored.
Items of a batch are scored by `workers` threads (code runs are subprocesses).

Started by the controller as a child process on 127.0.0.1 (`python -m
rewards.service`), or by `posttrain serve-rewards CONFIG.yaml` on any host. When a
bearer token is configured, requests without it get 401.

Limits: `math`, `length`, `format` and `python` run in this process, unsandboxed:
the first three parse text and never execute it; `python` functions are trusted
user code. Only `code` executes model output, inside rewards/sandbox.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import TypeAdapter

from posttrain.config.rewards import (
    LOCAL_TYPES,
    CodeReward,
    FormatReward,
    LengthReward,
    PythonReward,
    RewardSpec,
)
from posttrain.rewards.code_verifier import score_code
from posttrain.rewards.math_verifier import score_math
from posttrain.rewards.protocol import Score, ScoreItem, ScoreRequest, ScoreResponse
from posttrain.rewards.python_reward import load_function, score_python
from posttrain.rewards.sandbox import Limits, make_sandbox

log = logging.getLogger("posttrain.rewards")
Scorer = Callable[[ScoreItem], tuple[float, dict[str, Any]]]


def score_length(response: str, target_chars: int) -> tuple[float, dict[str, Any]]:
    """1 at exactly `target_chars` characters, falling linearly to 0 at 0 or 2× target."""
    n = len(response)
    return max(0.0, 1.0 - abs(n - target_chars) / target_chars), {"chars": n}


def make_scorer(spec: Any) -> Scorer:
    """A callable scoring one item for one local component spec.

    Raises:
        ValueError: an http component (the controller calls those), or a python
            function that cannot be imported.
        SandboxUnavailable: a code component whose sandbox cannot start.
    """
    if spec.type == "math":
        return lambda item: score_math(item.response, item.ground_truth)
    if isinstance(spec, LengthReward):
        return lambda item: score_length(item.response, spec.target_chars)
    if isinstance(spec, FormatReward):
        pattern = re.compile(spec.pattern, re.DOTALL)
        return lambda item: ((1.0 if pattern.search(item.response) else 0.0), {})
    if isinstance(spec, CodeReward):
        sandbox = make_sandbox(spec.sandbox)
        limits = Limits(wall_s=spec.timeout_s, cpu_s=spec.cpu_s, memory_mb=spec.memory_mb,
                        max_procs=spec.max_procs, max_output_bytes=spec.max_output_bytes)
        return lambda item: score_code(item, sandbox, limits)
    if isinstance(spec, PythonReward):
        fn = load_function(spec.function)
        return lambda item: score_python(fn, item)
    raise ValueError(f"reward {spec.name!r}: type {spec.type!r} is not served here; "
                     f"a reward service hosts {sorted(LOCAL_TYPES)}")


def parse_components(components: list[dict[str, Any]]) -> list[Any]:
    """Validate component dicts with the recipe's reward schema.

    Raises:
        pydantic.ValidationError: a malformed component.
    """
    return TypeAdapter(list[RewardSpec]).validate_python(components)


def create_app(components: list[dict[str, Any]], token: str | None = None,
               workers: int = 2) -> FastAPI:
    """The service for `components` (recipe reward entries as dicts).

    Raises:
        ValueError, SandboxUnavailable, pydantic.ValidationError: see `make_scorer`.
    """
    specs = parse_components(components)
    scorers = [(s.name, s.weight, make_scorer(s)) for s in specs]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="score")
    registry = CollectorRegistry()
    items_total = Counter("posttrain_reward_items", "Items scored, by component and outcome",
                          ["component", "outcome"], registry=registry)
    latency = Histogram("posttrain_reward_request_seconds", "POST /score latency, seconds",
                        registry=registry)

    def score_one(item: ScoreItem) -> Score:
        total, details = 0.0, {}
        for name, weight, scorer in scorers:
            try:
                value, extra = scorer(item)
            except Exception as e:  # a verifier or user-function error fails this item only
                items_total.labels(name, "error").inc()
                log.warning("reward %s failed on %s: %s", name, item.uid, e)
                return Score(uid=item.uid, reward=None, error=f"{name}: {e}", details=details)
            items_total.labels(name, "ok").inc()
            details[name] = value
            details.update({f"{name}.{k}": v for k, v in extra.items()})
            total += weight * value
        return Score(uid=item.uid, reward=total, details=details)

    app = FastAPI(title="posttrain reward service",
                  description="Scores rollouts; protocol in rewards/protocol.py.")

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        return generate_latest(registry).decode()

    def auth(authorization: str | None = Header(None)) -> None:
        if token and authorization != f"Bearer {token}":
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "components": [s.name for s in specs]}

    @app.post("/score", dependencies=[Depends(auth)])
    def score(req: ScoreRequest) -> ScoreResponse:
        uids = [i.uid for i in req.items]
        if len(set(uids)) != len(uids):
            raise HTTPException(status_code=422, detail="uids in one request must be unique")
        t0 = time.perf_counter()
        scores = list(pool.map(score_one, req.items))
        latency.observe(time.perf_counter() - t0)
        return ScoreResponse(scores=scores)

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="posttrain reward service")
    ap.add_argument("--components", required=True, help="JSON list of reward entries")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", type=int, default=2, help="items scored in parallel")
    ap.add_argument("--token-env", default="POSTTRAIN_REWARD_TOKEN",
                    help="environment variable holding the bearer token (unset: no auth)")
    args = ap.parse_args()
    app = create_app(json.loads(args.components), os.environ.get(args.token_env), args.workers)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
