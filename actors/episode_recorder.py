"""What the OpenAI endpoint (actors/openai_server.py) records per episode: every call's
prompt and sampled ids with their logprobs, the agent's reward, the conversation so far.

Concurrency: the store is thread-safe (`lock` guards the episodes, held only for
bookkeeping, never while a call samples); `turn(episode_id)` makes the calls of one
episode run one at a time, so its chain stays ordered, while calls of other episodes
sample at once (on a concurrent engine, or batched: actors/call_batcher.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Call:
    """One recorded completion (rollout worker → controller).

    Attributes:
        prompt_ids: `[P]` the ids the engine was given.
        completion_ids: `[C]` the sampled ids.
        logprobs: `[C]` their `inference_logprobs` (under the request's temperature).
        policy_version: version of the weights that sampled them.
        finish_reason: 'stop' or 'length'.
        temperature: the request's temperature.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: str
    temperature: float


@dataclass
class EpisodeLog:
    """Every call of one episode, the agent's reward (or why its posted reward was
    refused), and the conversation state."""

    calls: list[Call] = field(default_factory=list)
    reward: float | None = None
    reward_error: str | None = None
    components: dict[str, float] = field(default_factory=dict)
    restarts: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


class EpisodeRecorder:
    """Thread-safe store of `EpisodeLog`s by episode id, at most `max_episodes` of them
    (least recently used evicted first).

    Raises (at construction):
        ValueError: max_episodes < 1.
    """

    def __init__(self, max_episodes: int = 4096) -> None:
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be at least 1, got {max_episodes}")
        self.max_episodes = max_episodes
        self.lock = threading.Lock()
        self.episodes: OrderedDict[str, EpisodeLog] = OrderedDict()
        # per episode with a call in progress: its turn lock and how many calls hold or
        # wait for it (dropped at 0, so finished episodes leave nothing behind)
        self._turns: dict[str, tuple[threading.Lock, list[int]]] = {}

    @contextmanager
    def turn(self, episode_id: str) -> Iterator[None]:
        """Hold the episode's turn: one call of an episode at a time (its calls extend
        each other), any number of episodes at once."""
        with self.lock:
            turn, users = self._turns.setdefault(episode_id, (threading.Lock(), [0]))
            users[0] += 1
        try:
            with turn:
                yield
        finally:
            with self.lock:
                users[0] -= 1
                if users[0] == 0:
                    del self._turns[episode_id]

    def get(self, episode_id: str) -> EpisodeLog:
        """The episode's log, made when new (evicting the least recently used one when
        the store is full)."""
        with self.lock:
            return self.keep(episode_id, self.episodes.get(episode_id) or EpisodeLog())

    def keep(self, episode_id: str, log: EpisodeLog) -> EpisodeLog:
        """Store `log` under `episode_id` as the most recently used, evicting the least
        recently used beyond `max_episodes`; the caller holds `lock`."""
        self.episodes[episode_id] = log
        self.episodes.move_to_end(episode_id)
        while len(self.episodes) > self.max_episodes:
            self.episodes.popitem(last=False)
        return log

    def find(self, episode_id: str) -> EpisodeLog | None:
        """The episode's log if it has one here, else None (nothing is made)."""
        with self.lock:
            return self.episodes.get(episode_id)

    def pop(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's calls, reward, reward_error, components and restarts as plain
        data, removed; None if unknown."""
        with self.lock:
            log = self.episodes.pop(episode_id, None)
        if log is None:
            return None
        return {
            "calls": [asdict(c) for c in log.calls],
            "reward": log.reward,
            "reward_error": log.reward_error,
            "components": dict(log.components),
            "restarts": log.restarts,
        }
