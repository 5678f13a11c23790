"""The reward service: a FastAPI app serving `POST /score`, `GET /health`, Prometheus
`GET /metrics` and its OpenAPI schema at `/docs` and `/openapi.json`.

One service hosts the local components of a recipe's `rewards:` list (`math`,
`length`, `format`, `code`, `python`, `reward_model`, `judge`, `reasoning_gym`); an
item's reward is the weighted sum of the components that apply to it (a component with
`sources` applies only to items whose `metadata.data_source` it names; an item no
component applies to fails), each reported in `details`. A component that raises, or
runs past its `timeout_s`, or gives a value that is not a finite number (a reward
model's NaN, a judge's `inf`), marks that item as failed (`reward: null`, `error`
naming the component); the other items of the batch are still scored. Non-finite
numbers among a component's details are sent as text ('nan').

Concurrency: items of a batch are scored by `workers` threads. `math`, `format`,
`python` and `reasoning_gym` calls go to a pool of `workers` killable worker processes
(rewards/bounded.py), started with the service and kept for its life: each call has
a deadline (`timeout_s`) and each worker an address-space limit (the largest
`memory_mb` of those components); a call over its deadline is cut off, its worker
killed and replaced, and the service keeps answering (`/health` included) during and
after. `code` runs each program in a sandboxed subprocess with its own limits
(rewards/sandbox.py); `length` is a character count, in the thread. A `reward_model`
scores the whole request in batches before the threads start (rewards/reward_model.py;
its model loads when the service starts); a `judge` calls its endpoint from the thread
(rewards/judge.py).

Structure: the routes are module-level (`router`) and reach the service's state, a
`Scoring` (scorers, pools, token, metrics) built by `create_app`, through a dependency.

Started by the controller as a child process on 127.0.0.1 (`python -m
rewards.service`), or by `posttrain serve-rewards CONFIG.yaml` on any host. When a
bearer token is configured, requests without it get 401.

Limits: the worker processes are not a sandbox: `python` functions are trusted user
code with the service's rights; `math` and `format` parse model text and never execute
it. Only `code` executes model output, inside rewards/sandbox.py. A batch of items
that all time out takes about `timeout_s` × items / `workers`: keep the client's
request timeout above that, or batches small.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import TypeAdapter

from ..common.net import listen_socket
from ..config.rewards import (
    LOCAL_TYPES,
    CodeReward,
    FormatReward,
    JudgeReward,
    LengthReward,
    MathReward,
    PythonReward,
    ReasoningGymReward,
    RewardModelReward,
    RewardSpec,
)
from . import jobs
from .bounded import BoundedPool, VerifierTimeout
from .code_verifier import score_code
from .protocol import (
    Score,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
    finite_details,
    is_finite_number,
)
from .python_reward import load_function
from .sandbox import Limits, make_sandbox

log = logging.getLogger("posttrain.rewards")
Scorer = Callable[[ScoreItem], tuple[float, dict[str, Any]]]


def score_length(response: str, target_chars: int) -> tuple[float, dict[str, Any]]:
    """1 at exactly `target_chars` characters, falling linearly to 0 at 0 or 2× target."""
    n = len(response)
    return max(0.0, 1.0 - abs(n - target_chars) / target_chars), {"chars": n}


def make_scorer(spec: Any, pool: BoundedPool) -> Scorer:
    """A callable scoring one item for one local component spec; `math`, `format`,
    `python` and `reasoning_gym` calls run in `pool` within the spec's `timeout_s`.

    Raises:
        ValueError: an http component (the controller calls those), a python
            function that cannot be imported, a judge's unset token_env, a
            reward_model path that is not a loadable model folder (names it).
        SandboxUnavailable: a code component whose sandbox cannot start.
    """
    if isinstance(spec, MathReward):
        return lambda item: pool.call(
            jobs.math_job, (item.response, item.ground_truth), spec.timeout_s
        )
    if isinstance(spec, LengthReward):
        return lambda item: score_length(item.response, spec.target_chars)
    if isinstance(spec, FormatReward):
        return lambda item: pool.call(
            jobs.format_job, (spec.pattern, item.response), spec.timeout_s
        )
    if isinstance(spec, CodeReward):
        sandbox = make_sandbox(spec.sandbox)
        limits = Limits(
            wall_s=spec.timeout_s,
            cpu_s=spec.cpu_s,
            memory_mb=spec.memory_mb,
            max_procs=spec.max_procs,
            max_output_bytes=spec.max_output_bytes,
        )
        return lambda item: score_code(item, sandbox, limits, spec.float_tolerance)
    if isinstance(spec, PythonReward):
        load_function(spec.function)  # fail at start, not on every item, if it is missing
        return lambda item: pool.call(jobs.python_job, (spec.function, item), spec.timeout_s)
    if isinstance(spec, ReasoningGymReward):
        return lambda item: pool.call(
            jobs.reasoning_gym_job,
            (item.response, item.metadata.get("reasoning_gym"), spec.answer_tag),
            spec.timeout_s,
        )
    if isinstance(spec, RewardModelReward):  # torch only when a reward model is served
        from .reward_model import RewardModelScorer

        return RewardModelScorer(spec)
    if isinstance(spec, JudgeReward):
        from .judge import JudgeScorer

        return JudgeScorer(spec)
    raise ValueError(
        f"reward {spec.name!r}: type {spec.type!r} is not served here; "
        f"a reward service hosts {sorted(LOCAL_TYPES)}"
    )


def applies(sources: list[str] | None, item: ScoreItem) -> bool:
    """Whether a component with `sources` scores `item` (None: every item)."""
    return sources is None or item.metadata.get("data_source") in sources


def parse_components(components: list[dict[str, Any]]) -> list[Any]:
    """Validate component dicts with the recipe's reward schema.

    Raises:
        pydantic.ValidationError: a malformed component.
    """
    return TypeAdapter(list[RewardSpec]).validate_python(components)


class Scoring:
    """What one service holds: its components' scorers, the threads and worker processes
    that run them, its bearer token and its Prometheus metrics. One per app
    (`app.state.scoring`); the routes reach it through the `scoring` dependency.

    Args:
        components: recipe reward entries as dicts.
        token: the bearer token requests must carry; None: no auth.
        workers: items scored at once (threads, and worker processes).

    Raises:
        ValueError, SandboxUnavailable, pydantic.ValidationError: see `make_scorer`.
    """

    def __init__(self, components: list[dict[str, Any]], token: str | None, workers: int):
        self.specs = parse_components(components)
        self.token = token
        bounded = [
            s
            for s in self.specs
            if isinstance(s, MathReward | FormatReward | PythonReward | ReasoningGymReward)
        ]
        self.uses_processes = bool(bounded)
        self.processes = BoundedPool(workers, max((s.memory_mb for s in bounded), default=2048))
        self.scorers = [
            (s.name, s.weight, make_scorer(s, self.processes), s.sources) for s in self.specs
        ]
        # Scored per request in batches, before the per-item threads (reward models).
        self.batched = [
            (name, sc, src) for name, _, sc, src in self.scorers if hasattr(sc, "score_batch")
        ]
        self.threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="score")
        self.registry = CollectorRegistry()
        self.items_total = Counter(
            "posttrain_reward_items",
            "Items scored, by component and outcome",
            ["component", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "posttrain_reward_request_seconds",
            "POST /score latency, seconds",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "posttrain_reward_items_in_flight", "Items being scored now", registry=self.registry
        )

    def score(self, items: list[ScoreItem]) -> list[Score]:
        """One score per item, in order: the batched components first, then each item on
        the threads."""
        t0 = time.perf_counter()
        scores = list(self.threads.map(self.score_one, items, self.score_batches(items)))
        self.latency.observe(time.perf_counter() - t0)
        return scores

    def score_batches(self, items: list[ScoreItem]) -> list[dict[str, Any]]:
        """Per item, each batched component's `(value, extra)` or the exception it raised
        for the whole batch."""
        out: list[dict[str, Any]] = [{} for _ in items]
        for name, scorer, sources in self.batched:
            mine = [k for k, item in enumerate(items) if applies(sources, item)]
            try:
                results = scorer.score_batch([items[k] for k in mine]) if mine else []
            except Exception as e:  # a failed batch fails its items only, not the service
                results = [e] * len(mine)
            for k, r in zip(mine, results, strict=True):
                out[k][name] = r
        return out

    def score_one(self, item: ScoreItem, pre: dict[str, Any]) -> Score:
        """`item`'s weighted sum over the components that apply to it (`pre`: the batched
        components' results); a failing component fails the item, named."""
        with self.in_flight.track_inprogress():
            mine = [s for s in self.scorers if applies(s[3], item)]
            if not mine:
                source = item.metadata.get("data_source")
                return Score(
                    uid=item.uid,
                    reward=None,
                    error=f"no component applies to data_source {source!r} "
                    f"(sources: {[s.sources for s in self.specs]})",
                )
            total, details = 0.0, {}
            for name, weight, scorer, _ in mine:
                try:
                    if name in pre and isinstance(pre[name], Exception):
                        raise pre[name]
                    value, extra = pre[name] if name in pre else scorer(item)
                    if not is_finite_number(value):
                        raise ValueError(f"gave {value!r}, not a finite number")
                except Exception as e:  # a verifier or user-function error fails this item
                    timed_out = isinstance(e, VerifierTimeout)
                    self.items_total.labels(name, "timeout" if timed_out else "error").inc()
                    log.warning("reward %s failed on %s: %s", name, item.uid, e)
                    return Score(uid=item.uid, reward=None, error=f"{name}: {e}", details=details)
                self.items_total.labels(name, "ok").inc()
                details[name] = value
                details.update({f"{name}.{k}": v for k, v in finite_details(extra).items()})
                total += weight * value
            if not is_finite_number(total):
                error = f"the weighted sum of the components is {total!r}; lower the weights"
                return Score(uid=item.uid, reward=None, error=error, details=details)
            return Score(uid=item.uid, reward=total, details=details)

    def close(self) -> None:
        """Kill the worker processes and drop the queued items."""
        self.processes.close()
        self.threads.shutdown(wait=False, cancel_futures=True)


def scoring(request: Request) -> Scoring:
    """The app's `Scoring` (a route dependency)."""
    return request.app.state.scoring


State = Annotated[Scoring, Depends(scoring)]


def auth(state: State, authorization: Annotated[str | None, Header()] = None) -> None:
    """Requests carry the service's bearer token, when it has one.

    Raises:
        HTTPException: 401, a missing or wrong token.
    """
    if state.token and authorization != f"Bearer {state.token}":
        raise HTTPException(status_code=401, detail="missing or wrong bearer token")


router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(state: State) -> str:
    return generate_latest(state.registry).decode()


@router.get("/health")
def health(state: State) -> dict[str, Any]:
    return {"status": "ok", "components": [s.name for s in state.specs]}


@router.post("/score", dependencies=[Depends(auth)])
def score(req: ScoreRequest, state: State) -> ScoreResponse:
    uids = [i.uid for i in req.items]
    if len(set(uids)) != len(uids):
        raise HTTPException(status_code=422, detail="uids in one request must be unique")
    return ScoreResponse(scores=state.score(req.items))


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: Scoring = app.state.scoring
    if state.uses_processes:
        state.processes.warm()  # before serving: the first batch does not wait for imports
    yield
    state.close()


def create_app(
    components: list[dict[str, Any]], token: str | None = None, workers: int = 2
) -> FastAPI:
    """The service for `components` (recipe reward entries as dicts), scoring `workers`
    items at once. Under uvicorn its lifespan starts the worker processes before serving
    and kills them at shutdown; without a lifespan (a bare TestClient) they start on
    first use and die with the app.

    Raises:
        ValueError, SandboxUnavailable, pydantic.ValidationError: see `make_scorer`.
    """
    app = FastAPI(
        title="posttrain reward service",
        lifespan=_lifespan,
        description="Scores rollouts; protocol in rewards/protocol.py.",
    )
    app.state.scoring = Scoring(components, token, workers)
    app.include_router(router)
    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="posttrain reward service")
    ap.add_argument("--components", required=True, help="JSON list of reward entries")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="items scored in parallel (threads, and worker processes)",
    )
    ap.add_argument(
        "--token-env",
        default="POSTTRAIN_REWARD_TOKEN",
        help="environment variable holding the bearer token (unset: no auth)",
    )
    args = ap.parse_args()
    try:
        app = create_app(json.loads(args.components), os.environ.get(args.token_env), args.workers)
    except (ValueError, RuntimeError) as e:  # a broken component: one line in the log
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    sock = listen_socket(args.host, args.port)  # SO_REUSEADDR: a restart takes its port at once
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
