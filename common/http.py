"""HTTP requests with a deadline on the whole request, for every call posttrain makes
to a user's service (`type: http` rewards, LLM judges, environments).

Why: httpx's `timeout` bounds each operation (connect, each read, each write), so a
server that sends one byte a second holds a request with a 2 s timeout for as long as
it keeps dripping, then is accepted. `DeadlineClient(timeout_s)` bounds the whole
request instead: connect, send, the response's headers and its whole body, within
`timeout_s` seconds, else `RequestTimeout` (an `httpx.TimeoutException`, so callers
that retry on httpx errors retry it).

Structure: one daemon thread per process runs an asyncio loop (started on first use,
and again in a forked child); each request is an `httpx.AsyncClient` call under
`asyncio.wait_for`, so at the deadline it is cancelled and its connection closed.
Calls are thread-safe and block only their caller; each client keeps its own
connection pool.

Limits: the response body is read into memory whole; a client must not be called
from the loop's own thread (nothing in posttrain does).
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import httpx

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = -1


def _background_loop() -> asyncio.AbstractEventLoop:
    """This process's request loop, started on first use."""
    global _loop, _loop_pid
    with _lock:
        if _loop is None or _loop_pid != os.getpid():
            _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_loop.run_forever, name="posttrain-http", daemon=True).start()
        return _loop


class RequestTimeout(httpx.TimeoutException):
    """A request got no complete response within its `timeout_s` (the whole request)."""


class DeadlineClient:
    """A small synchronous HTTP client whose `timeout_s` bounds each whole request.

    Args:
        timeout_s: seconds for one request, from connect to the last byte of the body.
        headers: sent with every request (e.g. Authorization).
    """

    def __init__(self, timeout_s: float, headers: dict[str, str] | None = None):
        self.timeout_s = timeout_s
        self._loop = _background_loop()
        # No per-operation timeouts: the deadline in `_send` bounds every request.
        self._http = httpx.AsyncClient(timeout=None, headers=headers or {})

    async def _send(self, method: str, url: str, timeout_s: float, **kw: Any) -> httpx.Response:
        try:
            return await asyncio.wait_for(self._http.request(method, url, **kw), timeout_s)
        except TimeoutError:
            raise RequestTimeout(
                f"{method} {url} got no complete response within {timeout_s:g} s "
                "(timeout_s bounds the whole request)"
            ) from None

    def request(
        self, method: str, url: str, timeout_s: float | None = None, **kw: Any
    ) -> httpx.Response:
        """`method url` (httpx keyword arguments: json, params, headers...), its body read
        whole, within `timeout_s` (default: the client's).

        Raises:
            RequestTimeout: no complete response in time.
            httpx.HTTPError: the request failed otherwise (connection refused...).
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        future = asyncio.run_coroutine_threadsafe(self._send(method, url, limit, **kw), self._loop)
        return future.result()

    def post(self, url: str, **kw: Any) -> httpx.Response:
        """`request("POST", url, ...)`."""
        return self.request("POST", url, **kw)

    def get(self, url: str, **kw: Any) -> httpx.Response:
        """`request("GET", url, ...)`."""
        return self.request("GET", url, **kw)

    def close(self) -> None:
        """Close the connection pool (idempotent)."""
        if not self._loop.is_closed() and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result(timeout=10)
