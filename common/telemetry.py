"""Spans and idle-time accounting shared by every role (docs/design.md, "Telemetry").

Each role records `Span(role, worker, kind, start, end, step)` around its busy work
and returns them with its results; the controller merges them per step. Times are
`time.time()` seconds (wall clock), comparable across processes on one machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

BUSY_KINDS = frozenset(
    {"generate", "score", "forward", "backward", "optimizer", "weight_sync", "checkpoint"}
)


@dataclass(frozen=True)
class Span:
    """One busy interval of one worker.

    Attributes:
        role: 'rollout', 'learner', 'reward' or 'controller'.
        worker: worker index within its role.
        kind: one of BUSY_KINDS.
        start, end: wall-clock seconds (time.time()).
        step: training step the work belongs to.
    """

    role: str
    worker: int
    kind: str
    start: float
    end: float
    step: int

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class SpanRecorder:
    """Collects spans of one worker; `drain()` hands them over and clears the list.
    Thread-safe: a rollout worker's endpoint records spans from its server threads
    while the worker's own thread drains them."""

    def __init__(self, role: str, worker: int) -> None:
        self.role, self.worker = role, worker
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, kind: str, step: int) -> Iterator[None]:
        if kind not in BUSY_KINDS:
            raise ValueError(f"unknown span kind {kind!r}; use one of {sorted(BUSY_KINDS)}")
        start = time.time()
        try:
            yield
        finally:
            with self._lock:
                self._spans.append(Span(self.role, self.worker, kind, start, time.time(), step))

    def drain(self) -> list[Span]:
        with self._lock:
            spans, self._spans = self._spans, []
        return spans


def _merged_busy(spans: list[Span], start: float, end: float) -> float:
    """Seconds covered by the union of spans, clipped to [start, end]."""
    intervals = sorted((max(s.start, start), min(s.end, end)) for s in spans)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in intervals:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def busy_seconds(spans: list[Span], role: str, workers: int, start: float, end: float) -> float:
    """Busy worker-seconds of one side in [start, end]: the union of each worker's
    spans, summed over workers."""
    return sum(
        _merged_busy([s for s in spans if s.role == role and s.worker == w], start, end)
        for w in range(workers)
    )


def idle_fraction(spans: list[Span], role: str, workers: int, start: float, end: float) -> float:
    """Idle time over (wall time × workers) for one side, as docs/design.md defines it.

    Overlapping spans of one worker count once. Returns a value in [0, 1].

    Raises:
        ValueError: `end <= start` or `workers < 1`.
    """
    if end <= start or workers < 1:
        raise ValueError(f"need end > start and workers >= 1, got {start}, {end}, {workers}")
    busy = busy_seconds(spans, role, workers, start, end)
    return max(0.0, 1.0 - busy / ((end - start) * workers))


def generation_tail(spans: list[Span]) -> float:
    """Seconds between the first and last rollout worker finishing `generate`."""
    ends: dict[int, float] = {}
    for s in spans:
        if s.role == "rollout" and s.kind == "generate":
            ends[s.worker] = max(ends.get(s.worker, 0.0), s.end)
    return (max(ends.values()) - min(ends.values())) if ends else 0.0
