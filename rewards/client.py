"""Client side of the reward protocol (used by the controller), and a launcher for a
local reward service process.

Failure semantics: a request that fails (connection error, timeout, HTTP 5xx, a
malformed body) is retried with exponential backoff; after the last retry every
item of that batch gets `reward: None` and the error text. Scores are matched to
items by `uid`; an item missing from a response is failed, never silently 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from pydantic import ValidationError

from rewards.protocol import Score, ScoreItem, ScoreRequest, ScoreResponse


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
    ):
        self.url, self.retries, self.backoff_s = url, retries, backoff_s
        self.batch_size = batch_size
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(timeout=timeout_s, headers=headers)

    def _post(self, items: list[ScoreItem]) -> dict[str, Score]:
        body = ScoreRequest(items=items).model_dump()
        resp = self.http.post(self.url, json=body)
        resp.raise_for_status()
        return {s.uid: s for s in ScoreResponse.model_validate(resp.json()).scores}

    def _score_batch(self, items: list[ScoreItem]) -> list[Score]:
        last = ""
        for attempt in range(self.retries + 1):
            try:
                got = self._post(items)
                break
            except (httpx.HTTPError, ValidationError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
        else:
            return [Score(uid=i.uid, reward=None, error=f"request failed: {last}") for i in items]
        return [
            got.get(i.uid) or Score(uid=i.uid, reward=None, error="no score returned for this uid")
            for i in items
        ]

    def score(self, items: list[ScoreItem]) -> list[Score]:
        """One Score per item, in the items' order."""
        out: list[Score] = []
        for i in range(0, len(items), self.batch_size):
            out.extend(self._score_batch(items[i:i + self.batch_size]))
        return out

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
                if self.http.get(health, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"reward service at {health} did not answer within {timeout_s:.0f} s")

    def close(self) -> None:
        self.http.close()


def start_local_service(
    components_json: str, port: int, token: str, log_path: Path
) -> subprocess.Popen:
    """Start `python -m rewards.service` on 127.0.0.1:`port`, logging to `log_path`."""
    env = dict(os.environ, POSTTRAIN_REWARD_TOKEN=token, OMP_NUM_THREADS="1")
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    return subprocess.Popen(
        [sys.executable, "-m", "rewards.service", "--components", components_json,
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
