"""Client side of the reward protocols (used by the controller), the combination of
several reward endpoints into one reward per item, and a launcher for a local reward
service process.

Failure semantics: a request that fails (connection error, timeout, HTTP 5xx, a
malformed body, the wrong number of scores) is retried with exponential backoff; a
4xx other than 408/429 is not retried. `timeout_s` bounds each whole request, however
slowly the endpoint sends its answer (common/http.py). After the last try every item
of that batch gets `reward: None` and the error text. Scores are matched to items by
`uid`; an item missing from a response is failed, never silently 0; a non-finite
reward (`NaN`, `Infinity`, `1e400`) fails its item with an error naming the endpoint
(rewards/protocol.py `checked`), as does a weighted sum that overflows.

Protocols: `posttrain` (rewards/protocol.py) and `openrlhf` (request `{"query":
[prompt + response], "prompts": [...], "labels": [ground truth]}`, response
`{"rewards": [float, ...]}` in request order), so OpenRLHF remote reward models plug
in unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
from pydantic import ValidationError

from ..common.http import DeadlineClient
from .protocol import Score, ScoreItem, ScoreRequest, ScoreResponse, checked, is_finite_number


class RewardClient:
    """Scores items against one reward service URL (`.../score`)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 2,
        batch_size: int = 64,
        backoff_s: float = 0.5,
        protocol: Literal["posttrain", "openrlhf"] = "posttrain",
        max_concurrency: int = 1,
    ):
        self.url, self.retries, self.backoff_s = url, retries, backoff_s
        self.batch_size, self.protocol, self.max_concurrency = batch_size, protocol, max_concurrency
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = DeadlineClient(timeout_s, headers)

    def _post(self, items: list[ScoreItem]) -> dict[str, Score]:
        if self.protocol == "openrlhf":
            body = {
                "query": [i.prompt + i.response for i in items],
                "prompts": [i.prompt for i in items],
                "labels": [i.ground_truth for i in items],
            }
        else:
            body = ScoreRequest(items=items).model_dump()
        resp = self.http.post(self.url, json=body)
        resp.raise_for_status()
        try:
            data = resp.json()
        except ValueError:  # an HTML error page, a proxy's text: name what came back
            raise ValueError(
                f"{self.url} answered {resp.status_code} with a body that is not JSON: "
                f"{resp.text[:200]!r}"
            ) from None
        if self.protocol == "posttrain":
            try:
                scores = ScoreResponse.model_validate(data).scores
            except ValidationError as e:  # one line, not pydantic's multi-line dump
                first = e.errors()[0]
                loc = ".".join(str(x) for x in first["loc"]) or "the body"
                raise ValueError(
                    f"{self.url} answered a body that is not a score response: {loc}: "
                    f"{first['msg']} ({e.error_count()} problem(s); the protocol: "
                    "docs/rewards.md)"
                ) from None
            return {s.uid: checked(s, self.url) for s in scores}
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(items):
            got = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
            raise ValueError(f"openrlhf endpoint returned {got} rewards for {len(items)} items")
        if not all(isinstance(r, int | float) and not isinstance(r, bool) for r in rewards):
            raise ValueError("openrlhf endpoint returned a non-numeric reward")
        return {
            i.uid: checked(Score(uid=i.uid, reward=float(r)), self.url)
            for i, r in zip(items, rewards, strict=True)
        }

    def _score_batch(self, items: list[ScoreItem]) -> list[Score]:
        last, got = "", None
        for attempt in range(self.retries + 1):
            try:
                got = self._post(items)
                break
            except (httpx.HTTPError, ValidationError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
                status = e.response.status_code if isinstance(e, httpx.HTTPStatusError) else 0
                if 400 <= status < 500 and status not in (408, 429):
                    break  # the request itself is wrong; repeating it cannot help
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
        if got is None:
            return [Score(uid=i.uid, reward=None, error=f"request failed: {last}") for i in items]
        return [
            got.get(i.uid) or Score(uid=i.uid, reward=None, error="no score returned for this uid")
            for i in items
        ]

    def score(self, items: list[ScoreItem]) -> list[Score]:
        """One Score per item, in the items' order."""
        batches = [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            return [s for part in pool.map(self._score_batch, batches) for s in part]

    def wait_ready(self, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
        """Block until `GET /health` answers.

        Raises:
            RuntimeError: the service process exited, or did not answer in time.
        """
        health = self.url.rsplit("/", 1)[0] + "/health"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"reward service exited with code {proc.returncode}")
            try:
                if self.http.get(health, timeout_s=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"reward service at {health} did not answer within {timeout_s:.0f} s")

    def close(self) -> None:
        self.http.close()


def start_local_service(
    components_json: str, port: int, token: str, log_path: Path, workers: int = 2
) -> subprocess.Popen:
    """Start `python -m posttrain.rewards.service` on 127.0.0.1:`port`, logging to `log_path`."""
    env = dict(os.environ, POSTTRAIN_REWARD_TOKEN=token, OMP_NUM_THREADS="1")
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "posttrain.rewards.service",
            "--components",
            components_json,
            "--port",
            str(port),
            "--workers",
            str(workers),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


class RewardSet:
    """Every reward component of a run behind one `score` call.

    The local service already returns the weighted sum of its components; each HTTP
    endpoint adds `weight × reward` and its value under its name in `details`. An item
    goes only to the services with a component that applies to it (`local_sources`:
    the local components' `sources`, `endpoint_sources`: each endpoint's by name; a
    component with sources None applies to every item, else to items whose
    `metadata.data_source` it lists). An item fails (reward None) if any component
    failed for it, or none applies to it; the error names the component. A sum that
    overflows to infinity fails the item too.
    """

    def __init__(
        self,
        local: RewardClient | None,
        endpoints: list[tuple[str, float, RewardClient]],
        local_sources: list[list[str] | None] | None = None,
        endpoint_sources: dict[str, list[str] | None] | None = None,
    ):
        self.local, self.endpoints = local, endpoints
        self.local_sources = [None] if local_sources is None else local_sources
        self.endpoint_sources = endpoint_sources or {}

    @staticmethod
    def _applies(sources: list[list[str] | None], item: ScoreItem) -> bool:
        source = item.metadata.get("data_source")
        return any(s is None or source in s for s in sources)

    @staticmethod
    def _some(client: RewardClient, items: list[ScoreItem], mine: list[int]) -> dict[int, Score]:
        scores = client.score([items[k] for k in mine]) if mine else []
        return dict(zip(mine, scores, strict=True))

    def score(self, items: list[ScoreItem]) -> list[Score]:
        """One combined Score per item, in the items' order."""
        parts: list[tuple[tuple[str, float] | None, dict[int, Score]]] = []
        if self.local:
            mine = [k for k, i in enumerate(items) if self._applies(self.local_sources, i)]
            parts.append((None, self._some(self.local, items, mine)))
        for name, weight, client in self.endpoints:
            sources = [self.endpoint_sources.get(name)]
            mine = [k for k, i in enumerate(items) if self._applies(sources, i)]
            parts.append(((name, weight), self._some(client, items, mine)))
        out = []
        for k, item in enumerate(items):
            total, details, errors, scored = 0.0, {}, [], False
            for nw, got in parts:
                s = got.get(k)
                if s is None:
                    continue
                scored = True
                if s.reward is None:
                    error = s.error or "no reward and no error"
                    errors.append(error if nw is None else f"{nw[0]}: {error}")
                    continue
                total += s.reward if nw is None else nw[1] * s.reward
                details.update(
                    s.details
                    if nw is None
                    else {nw[0]: s.reward, **{f"{nw[0]}.{a}": b for a, b in s.details.items()}}
                )
            if not scored:
                source = item.metadata.get("data_source")
                errors.append(f"no reward component applies to data_source {source!r}")
            if not errors and not is_finite_number(total):
                errors.append(f"the weighted sum of the rewards is {total!r}; lower the weights")
            out.append(
                Score(
                    uid=item.uid,
                    reward=None if errors else total,
                    error="; ".join(errors) or None,
                    details=details,
                )
            )
        return out

    def close(self) -> None:
        for client in ([self.local] if self.local else []) + [e for _, _, e in self.endpoints]:
            client.close()
