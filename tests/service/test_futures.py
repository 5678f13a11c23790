"""`FutureStore`: a running request answers `try_again` (not done), a finished one its
result once, a user error category `user`, any other exception category `server`."""

from __future__ import annotations

import asyncio
import threading

from posttrain.service.errors import UserError
from posttrain.service.futures import FutureStore


def test_pending_then_done_then_forgotten() -> None:
    store, gate = FutureStore(), threading.Event()
    rid = store.submit(lambda: gate.wait(5) and {"ok": 1})
    assert asyncio.run(store.retrieve(rid, 0.01)) == (False, None)
    gate.set()
    assert asyncio.run(store.retrieve(rid, 5)) == (True, {"ok": 1})
    assert not store.known(rid)


def test_failures_carry_their_category() -> None:
    store = FutureStore()

    def user() -> None:
        raise UserError("path", "no such checkpoint")

    def server() -> None:
        raise RuntimeError("boom")

    a, b = store.submit(user), store.submit(server)
    assert asyncio.run(store.retrieve(a, 5)) == (
        True,
        {"error": "path: no such checkpoint", "category": "user"},
    )
    assert asyncio.run(store.retrieve(b, 5)) == (
        True,
        {"error": "RuntimeError: boom", "category": "server"},
    )
