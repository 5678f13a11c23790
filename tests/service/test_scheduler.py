"""The service's scheduler: a running request answers `try_again`, a finished one its
result once, failures carry their category; each session's requests keep their order,
sessions are served in turn, a finished session's waiting requests are cancelled, and a
request id of an earlier process is recognised."""

from __future__ import annotations

import asyncio
import threading

from posttrain.service.errors import UserError
from posttrain.service.scheduler import RoundRobinQueue, Scheduler


def test_pending_then_done_then_forgotten() -> None:
    s, gate = Scheduler(), threading.Event()
    rid = s.submit("learner", "a", lambda: gate.wait(5) and {"ok": 1})
    assert asyncio.run(s.retrieve(rid, 0.01)) == (False, None)
    gate.set()
    assert asyncio.run(s.retrieve(rid, 5)) == (True, {"ok": 1})
    assert not s.known(rid)
    s.shutdown()


def test_failures_carry_their_category() -> None:
    s = Scheduler()

    def user() -> None:
        raise UserError("path", "no such checkpoint")

    def server() -> None:
        raise RuntimeError("boom")

    a, b = s.submit("learner", "x", user), s.submit("learner", "x", server)
    assert asyncio.run(s.retrieve(a, 5)) == (
        True,
        {"error": "path: no such checkpoint", "category": "user"},
    )
    assert asyncio.run(s.retrieve(b, 5)) == (
        True,
        {"error": "RuntimeError: boom", "category": "server"},
    )
    s.shutdown()


def test_lanes_keep_their_order_and_take_turns() -> None:
    """A holds the worker; A queues 3 more, then B 2 and C 1: the worker runs A's first
    waiting call, then B's, C's, A's, B's, A's: each lane in order, lanes in turn."""
    q, gate, ran = RoundRobinQueue("t"), threading.Event(), []
    q.put("A", lambda: gate.wait(5))
    for _ in range(500):  # until the worker holds it
        if q.running == "A":
            break
        threading.Event().wait(0.01)
    futs = [
        q.put(lane, lambda n=f"{lane}{i}": ran.append(n))
        for lane, i in [("A", 1), ("A", 2), ("A", 3), ("B", 1), ("B", 2), ("C", 1)]
    ]
    assert q.depth() == 6
    gate.set()
    for f in futs:
        f.result(timeout=5)
    assert ran == ["A1", "B1", "C1", "A2", "B2", "A3"]
    q.close()


def test_a_finished_session_loses_its_waiting_requests() -> None:
    s, gate = Scheduler(), threading.Event()
    s.submit("learner", "busy", lambda: gate.wait(5))
    rid = s.submit("learner", "gone", lambda: {"ran": True})
    assert s.drop("gone") == 1
    gate.set()
    done, payload = asyncio.run(s.retrieve(rid, 5))
    assert done and payload["category"] == "user" and "cancelled" in payload["error"]
    s.shutdown()


def test_request_ids_of_an_earlier_process_are_recognised() -> None:
    a, b = Scheduler(), Scheduler()
    rid = a.submit("sampler", "x", lambda: 1)
    assert b.from_earlier_process(rid) and not a.from_earlier_process(rid)
    a.shutdown()
    b.shutdown()


def test_a_silent_session_loses_its_waiting_requests(tmp_path) -> None:  # noqa: ANN001
    """Issue 47: a dead client's queued requests kept the worker busy."""
    from posttrain.config.service import ServiceConfig
    from posttrain.service.registry import ModelRecord, Registry
    from posttrain.service.state import ServiceState

    reg = Registry(tmp_path)
    reg.sessions = {"s1": ["m1"], "s2": ["m2"]}
    reg.models = {m: ModelRecord(m, s, "b", 2) for s, m in (("s1", "m1"), ("s2", "m2"))}
    st = ServiceState("tml-x", tmp_path, ServiceConfig(), None, reg)
    gate = threading.Event()
    st.scheduler.submit("learner", "busy", lambda: gate.wait(5))
    rids = [st.scheduler.submit("learner", m, lambda: 1) for m in ("m1", "m1", "m2")]
    st.last_seen = {"s1": 0.0, "s2": 1000.0}
    assert st.reap_idle(now=1000.0 + 60) == 2  # s1 silent 1060 s, s2 60 s (limit 120)
    gate.set()
    assert [asyncio.run(st.scheduler.retrieve(r, 5))[1] for r in rids][2] == 1
    st.scheduler.shutdown()


def test_ready_requests_of_several_sessions_run_as_one_batch() -> None:
    """A holds the worker; B, C, D each queue a batchable call of one group and C a
    second: the next run takes B's, C's and D's heads together (limit 3, lane order),
    then C's second alone."""
    from posttrain.service.scheduler import Batchable

    q, gate, runs = RoundRobinQueue("t"), threading.Event(), []

    def run(payloads: list[str]) -> list[str]:
        runs.append(payloads)
        return [p.upper() for p in payloads]

    q.put("A", lambda: gate.wait(5))
    for _ in range(500):
        if q.running == "A":
            break
        threading.Event().wait(0.01)
    futs = {}
    for lane, name in [("B", "b1"), ("C", "c1"), ("C", "c2"), ("D", "d1")]:
        futs[name] = q.put(lane, lambda n=name: run([n])[0], Batchable("fb", name, run, 3))
    other = q.put("E", lambda: "e", Batchable("other", "e1", run, 3))
    gate.set()
    assert {k: f.result(timeout=5) for k, f in futs.items()} == {
        "b1": "B1",
        "c1": "C1",
        "c2": "C2",
        "d1": "D1",
    }
    assert other.result(timeout=5) == "e"
    assert runs == [["b1", "c1", "d1"], ["c2"]]
    q.close()


def test_a_batch_waits_for_requests_that_arrive_just_after_it() -> None:
    """Requests sent at once arrive milliseconds apart: with `batch_wait_s` the first
    waits for the others and all run as one batch (without it, it ran alone)."""
    from posttrain.service.scheduler import Batchable

    runs: list[list[str]] = []

    def run(payloads: list[str]) -> list[str]:
        runs.append(payloads)
        return payloads

    q = RoundRobinQueue("t", batch_wait_s=5.0)
    futs = []
    for lane in ("a", "b", "c"):
        futs.append(q.put(lane, lambda n=lane: run([n])[0], Batchable("fb", lane, run, 3)))
        threading.Event().wait(0.05)  # the worker holds "a" meanwhile
    assert [f.result(timeout=10) for f in futs] == ["a", "b", "c"]
    assert runs == [["a", "b", "c"]]  # full at 3: no need to wait the 5 s out
    q.close()


def test_a_request_of_a_killed_process_is_gone_not_failed(tmp_path) -> None:  # noqa: ANN001
    """A poll for a request in flight when the service was killed: 410 Gone, which the
    SDK raises as its retryable `RetryableException` (it was a 200 failure of category
    `server`: a non-retryable `RequestFailedError`)."""
    from fastapi.testclient import TestClient

    from posttrain.config.service import ServiceConfig
    from posttrain.service.app import create_app
    from posttrain.service.registry import Registry
    from posttrain.service.state import ServiceState

    st = ServiceState("tml-x", tmp_path, ServiceConfig(), None, Registry(tmp_path))
    with TestClient(create_app(st)) as http:
        got = http.post(
            "/api/v1/retrieve_future",
            json={"request_id": "req-0badf00d-7"},
            headers={"X-API-Key": "tml-x"},
        )
    assert got.status_code == 410
    assert got.json()["field"] == "request_id" and "send it again" in got.json()["detail"]
    st.scheduler.shutdown()
