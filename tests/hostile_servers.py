"""Hostile HTTP servers for boundary tests, on 127.0.0.1 only; `serve_app` serves any
ASGI app (a test's own environment server) in this process.

`SlowDrip` answers every request with one complete, valid HTTP response, but sends it
one byte every `interval_s` seconds: each read of the client gets data well inside a
per-read timeout, so only a deadline on the whole request stops it. Its loops are
bounded (the response's bytes, an accept poll that ends with the context) and it stops
writing as soon as the client goes away.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


def http_response(body: Any, status: int = 200) -> bytes:
    """A complete HTTP/1.1 response carrying `body`: JSON text as given when a str (so
    a test can send `NaN` or `1e400` literally), else `json.dumps(body)`."""
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    head = (
        f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + data


class SlowDrip:
    """`with SlowDrip(body) as url:` a server whose every response is `body` (JSON),
    sent one byte each `interval_s` (from the first byte with `drip_headers`, else after
    the headers sent at once; `interval_s=0`: all at once, a plain canned server).
    `requests` counts the requests it took."""

    def __init__(self, body: Any, interval_s: float = 0.25, drip_headers: bool = False):
        self.response = http_response(body)
        self.interval_s, self.drip_headers = interval_s, drip_headers
        self.requests = 0
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __enter__(self) -> str:
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                self._read_request(conn)
                self.requests += 1
                split = self.response.index(b"\r\n\r\n") + 4
                start = 0 if self.drip_headers else split
                if not self.interval_s:
                    start = len(self.response)
                conn.sendall(self.response[:start])
                for k in range(start, len(self.response)):  # bounded: the response's bytes
                    if self._stop.wait(self.interval_s):
                        return
                    conn.sendall(self.response[k : k + 1])
            except OSError:
                return  # the client gave up (the point of the test) or went away

    @staticmethod
    def _read_request(conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 1 << 20:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        deadline = time.monotonic() + 5
        while len(body) < length and time.monotonic() < deadline:
            chunk = conn.recv(65536)
            if not chunk:
                return
            body += chunk


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """`with serve_app(app) as url:` an ASGI app (FastAPI) served by uvicorn on a thread
    of this process at 127.0.0.1 (HTTP and WebSocket), stopped on exit."""
    import httpx
    import uvicorn

    from posttrain.common.net import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):  # bounded: 10 s for the server to listen
        try:
            httpx.get(url)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
