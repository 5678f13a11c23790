"""Futures of the service, scheduled per role: every training or sampling request is
queued and answered at once with a `request_id`; the SDK then polls
`/api/v1/retrieve_future` for it.

Order: one queue per role (`learner`: every verb on the learner group, which are
collectives and run one at a time; `sampler`: sampling on the engines). Inside a queue
each session (lane) keeps its requests in arrival order, so a `forward_backward` is
applied before the `optim_step` sent after it (the SDK's contract); lanes are served
round-robin, one request each in turn, so no session starves behind another's backlog.
Batching: a call queued with a `Batchable` runs together with the waiting heads of other
lanes of the same group (the learner: several sessions' forward_backward in one pass).
A result is kept until it is retrieved, then dropped.

Restarts: request ids carry this process's boot id, so a poll for a request of an
earlier process (in flight when the service was killed) is answered 410 Gone saying to
send it again (the SDK's retryable "promise expired"), never with another's result.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

from .errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batchable:
    """How a queued call may join others in one run: calls whose `group` is equal run as
    `run([payload, ...]) -> [result, ...]` (in that order), at most `limit` at once."""

    group: Hashable
    payload: Any
    run: Callable[[list[Any]], list[Any]]
    limit: int = 1


@dataclass
class Call:
    fut: Future
    fn: Callable[[], Any]
    batch: Batchable | None = None


class RoundRobinQueue:
    """One worker thread running queued calls: per lane in arrival order, lanes in turn.

    `batch_wait_s`: how long a batchable head call waits for the heads of other lanes
    to join it (up to its `limit`) before it runs: requests sent at once by several
    clients arrive milliseconds apart, and without a wait the first would run alone.
    """

    def __init__(self, name: str, batch_wait_s: float = 0.0) -> None:
        self.name = name
        self.batch_wait_s = batch_wait_s
        self._lanes: OrderedDict[str, deque[tuple[Future, Callable[[], Any]]]] = OrderedDict()
        self._cv = threading.Condition()
        self._closed = False
        self.running: str | None = None  # the lane of the call running now
        self._thread = threading.Thread(target=self._run, name=f"serve-{name}", daemon=True)
        self._thread.start()

    def put(self, lane: str, fn: Callable[[], Any], batch: Batchable | None = None) -> Future:
        """Queue `fn` in `lane`; with `batch`, it may run together with the waiting heads
        of other lanes that carry a batchable of the same `group` (`Batchable.run`)."""
        fut: Future = Future()
        with self._cv:
            self._lanes.setdefault(lane, deque()).append(Call(fut, fn, batch))
            self._cv.notify()
        return fut

    def depth(self) -> int:
        """Calls waiting (not counting the one running)."""
        with self._cv:
            return sum(len(q) for q in self._lanes.values())

    def drop(self, lane: str) -> int:
        """Cancel the calls `lane` still has waiting (a client gone); returns how many."""
        with self._cv:
            waiting = self._lanes.pop(lane, deque())
        for call in waiting:
            call.fut.cancel()
        return len(waiting)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            lanes, self._lanes = self._lanes, OrderedDict()
            self._cv.notify_all()
        for q in lanes.values():
            for call in q:
                call.fut.cancel()

    def _next(self) -> tuple[str, list[Call]] | None:
        """The next lane in turn and its head call, with the heads of later lanes that
        batch with it (same `group`, up to its `limit`)."""
        with self._cv:
            while not self._closed and not any(self._lanes.values()):
                self._cv.wait()
            if self._closed:
                return None
            lane = next(k for k, q in self._lanes.items() if q)
            calls = [self._pop(lane)]
            b = calls[0].batch
            if b is None or b.limit == 1:
                return lane, calls
            deadline, taken = time.monotonic() + self.batch_wait_s, {lane}
            while True:
                self._join(calls, taken)
                left = deadline - time.monotonic()
                if len(calls) == b.limit or left <= 0 or self._closed:
                    break
                self._cv.wait(left)
            if self._closed:  # closed while waiting: these were taken off their lanes
                for call in calls:
                    call.fut.cancel()
                return None
            return lane, calls

    def _join(self, calls: list[Call], lanes: set[str]) -> None:
        """Add to `calls` the waiting heads of other lanes that batch with its first
        (same `group`, up to its `limit`); `lanes`: those taken from (one call each)."""
        b = calls[0].batch
        for other, q in list(self._lanes.items()):
            if len(calls) == b.limit:
                break
            head = q[0].batch if q else None
            if other not in lanes and head is not None and head.group == b.group:
                calls.append(self._pop(other))
                lanes.add(other)

    def _pop(self, lane: str) -> Call:
        """`lane`'s head call; the lane goes last in turn (or away when empty)."""
        call = self._lanes[lane].popleft()
        if self._lanes[lane]:
            self._lanes.move_to_end(lane)
        else:
            del self._lanes[lane]
        return call

    def _run(self) -> None:
        while (item := self._next()) is not None:
            lane, calls = item
            calls = [c for c in calls if c.fut.set_running_or_notify_cancel()]
            if not calls:
                continue
            self.running = lane
            try:
                if len(calls) == 1:
                    results = [calls[0].fn()]
                else:
                    results = calls[0].batch.run([c.batch.payload for c in calls])
                for c, r in zip(calls, results, strict=True):
                    c.fut.set_result(r)
            except BaseException as e:  # reported through every future, never lost
                for c in calls:
                    if not c.fut.done():
                        c.fut.set_exception(e)
            finally:
                self.running = None


class Scheduler:
    """`submit(queue, lane, fn)` → request id; `retrieve(id, wait_s)` → its payload."""

    QUEUES = ("learner", "sampler")

    def __init__(self, batch_wait_s: float = 0.0) -> None:
        self.boot = secrets.token_hex(4)
        self.queues = {q: RoundRobinQueue(q, batch_wait_s) for q in self.QUEUES}
        self._futures: dict[str, Future] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def submit(
        self, queue: str, lane: str, fn: Callable[[], Any], batch: Batchable | None = None
    ) -> str:
        with self._lock:
            rid = f"req-{self.boot}-{next(self._ids)}"
            self._futures[rid] = self.queues[queue].put(lane, fn, batch)
        return rid

    def known(self, rid: str) -> bool:
        return rid in self._futures

    def from_earlier_process(self, rid: str) -> bool:
        """A request id this service gave out before a restart (not this boot's)."""
        return rid.startswith("req-") and not rid.startswith(f"req-{self.boot}-")

    def drop(self, lane: str) -> int:
        return sum(q.drop(lane) for q in self.queues.values())

    def depths(self) -> dict[str, int]:
        return {name: q.depth() for name, q in self.queues.items()}

    async def retrieve(self, rid: str, wait_s: float) -> tuple[bool, Any]:
        """(done, payload): payload is the function's result, or for a failure the
        dict the SDK reads as a failed request ({"error", "category"})."""
        fut = self._futures[rid]
        if fut.cancelled():
            self._futures.pop(rid, None)
            return True, {"error": "cancelled: its session finished", "category": "user"}
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), wait_s)
        except TimeoutError:
            return False, None
        except UserError as e:
            self._futures.pop(rid, None)
            return True, {"error": str(e), "category": "user"}
        except (CancelledError, asyncio.CancelledError):
            if not fut.cancelled():
                raise  # the poll itself was cancelled (client gone), not the request
            self._futures.pop(rid, None)
            return True, {"error": "cancelled: its session finished", "category": "user"}
        except Exception as e:  # a server fault: reported to the client, service stays up
            log.exception("request %s failed", rid)
            self._futures.pop(rid, None)
            return True, {"error": f"{type(e).__name__}: {e}", "category": "server"}
        self._futures.pop(rid, None)
        return True, fut.result()

    def shutdown(self) -> None:
        for q in self.queues.values():
            q.close()
