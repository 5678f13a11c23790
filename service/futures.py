"""Futures of the service: every training or sampling request is queued on one worker
thread and answered at once with a `request_id`; the SDK then polls
`/api/v1/retrieve_future` for it.

Order: requests run in the order they arrived, one at a time (the SDK sends a model's
requests in its own order, `seq_id`), so a `forward_backward` is applied before the
`optim_step` sent after it. A result is kept until it is retrieved, then dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .errors import UserError

log = logging.getLogger(__name__)


class FutureStore:
    """`submit(fn)` → request id; `retrieve(id, wait_s)` → its payload, or None while
    it is still running."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-serve")
        self._futures: dict[str, Future] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> str:
        with self._lock:
            rid = f"req-{next(self._ids)}"
            self._futures[rid] = self._pool.submit(fn)
        return rid

    def known(self, rid: str) -> bool:
        return rid in self._futures

    async def retrieve(self, rid: str, wait_s: float) -> tuple[bool, Any]:
        """(done, payload): payload is the function's result, or for a failure the
        dict the SDK reads as a failed request ({"error", "category"})."""
        fut = self._futures[rid]
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), wait_s)
        except TimeoutError:
            return False, None
        except UserError as e:
            self._futures.pop(rid, None)
            return True, {"error": str(e), "category": "user"}
        except Exception as e:  # a server fault: reported to the client, service stays up
            log.exception("request %s failed", rid)
            self._futures.pop(rid, None)
            return True, {"error": f"{type(e).__name__}: {e}", "category": "server"}
        self._futures.pop(rid, None)
        return True, fut.result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
