"""`DeadlineClient`: `timeout_s` bounds the whole request, not each read."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.common.http import DeadlineClient, RequestTimeout
from tests.hostile_servers import SlowDrip


@pytest.mark.parametrize("drip_headers", [False, True], ids=["body", "headers"])
def test_a_dripping_server_is_cut_at_the_deadline(drip_headers):
    """One byte each 0.25 s keeps every read inside a 1 s per-read timeout; the body
    takes about 4 s to arrive, the deadline is 1 s."""
    with SlowDrip({"ok": True, "pad": "x" * 10}, drip_headers=drip_headers) as url:
        client = DeadlineClient(1.0)
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match="within 1 s"):
            client.post(f"{url}/x", json={})
        assert time.monotonic() - t0 < 3.0
        client.close()


def test_a_prompt_server_answers_and_calls_run_concurrently():
    with SlowDrip({"ok": True}, interval_s=0) as url:
        client = DeadlineClient(5.0)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda _: client.get(f"{url}/x").json(), range(8)))
        client.close()
        client.close()  # idempotent
    assert got == [{"ok": True}] * 8


def test_per_call_deadline_overrides_the_clients():
    with SlowDrip({"ok": True, "pad": "x" * 40}) as url:
        client = DeadlineClient(60.0)
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            client.get(f"{url}/x", timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
        client.close()
