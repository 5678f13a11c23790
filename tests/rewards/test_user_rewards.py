"""Users' rewards: http endpoints (both protocols), python functions, combination, and
fault drills — each failure is retried, then recorded as failed, never 0."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient

from posttrain.common.net import free_port
from posttrain.recipes.algo.rollouts import RewardFailure, apply_failure_policy
from posttrain.rewards.client import RewardClient, RewardSet
from posttrain.rewards.protocol import Score, ScoreItem
from posttrain.rewards.service import create_app
from tests.conftest import ROOT

CALLS: dict[str, int] = {}


def _fake_endpoints() -> FastAPI:
    app = FastAPI()

    def count(name: str) -> None:
        CALLS[name] = CALLS.get(name, 0) + 1

    @app.post("/ok")
    async def ok(req: Request):
        count("ok")
        items = (await req.json())["items"]
        return {"scores": [{"uid": i["uid"], "reward": len(i["response"]) / 10} for i in items]}

    @app.post("/slow")
    async def slow(req: Request):
        count("slow")
        await asyncio.sleep(1.5)
        return {"scores": []}

    @app.post("/error500")
    async def error500():
        count("error500")
        return PlainTextResponse("boom", status_code=500)

    @app.post("/malformed")
    async def malformed():
        count("malformed")
        return PlainTextResponse("{not json", media_type="application/json")

    @app.post("/short")
    async def short(req: Request):
        count("short")
        items = (await req.json())["items"]
        return {"scores": [{"uid": items[0]["uid"], "reward": 1.0}]}

    @app.post("/openrlhf")
    async def openrlhf(req: Request):
        count("openrlhf")
        body = await req.json()
        assert set(body) == {"query", "prompts", "labels"}
        return {
            "rewards": [
                float(q.endswith(lab)) for q, lab in zip(body["query"], body["labels"], strict=True)
            ]
        }

    @app.post("/openrlhf_short")
    async def openrlhf_short(req: Request):
        count("openrlhf_short")
        return {"rewards": [1.0]}

    return app


@pytest.fixture(scope="module")
def endpoints():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_fake_endpoints(), port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _items(n=3):
    return [
        ScoreItem(uid=f"u{k}", prompt="Q: ", response="x" * (k + 1), ground_truth="x")
        for k in range(n)
    ]


def _client(base, route, **kw):
    kw.setdefault("retries", 2)
    return RewardClient(f"{base}/{route}", backoff_s=0.01, timeout_s=kw.pop("timeout_s", 5), **kw)


def test_posttrain_endpoint(endpoints):
    scores = _client(endpoints, "ok").score(_items())
    assert [s.reward for s in scores] == pytest.approx([0.1, 0.2, 0.3])


def test_openrlhf_endpoint_plugs_in(endpoints):
    scores = _client(endpoints, "openrlhf", protocol="openrlhf").score(_items())
    assert [s.reward for s in scores] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("route", "protocol", "needle"),
    [
        ("slow", "posttrain", "RequestTimeout"),
        ("error500", "posttrain", "500"),
        ("malformed", "posttrain", "/malformed answered 200 with a body that is not JSON"),
        ("openrlhf_short", "openrlhf", "returned 1 rewards for 3 items"),
    ],
)
def test_fault_drills_fail_items_after_retries(endpoints, route, protocol, needle):
    CALLS.clear()
    client = _client(endpoints, route, protocol=protocol, timeout_s=0.5)
    t0 = time.monotonic()
    scores = client.score(_items())
    assert [s.reward for s in scores] == [None, None, None]
    assert all(needle in s.error for s in scores), scores[0].error
    assert CALLS[route] == 3  # first try + 2 retries
    assert time.monotonic() - t0 < 15  # bounded by timeouts, never hangs


def test_refused_connection_fails_items():
    scores = _client(f"http://127.0.0.1:{free_port()}", "score").score(_items())
    assert [s.reward for s in scores] == [None] * 3 and "ConnectError" in scores[0].error


def test_wrong_number_of_posttrain_scores_fails_only_missing(endpoints):
    scores = _client(endpoints, "short").score(_items())
    assert scores[0].reward == 1.0
    assert [s.reward for s in scores[1:]] == [None, None]
    assert "no score returned" in scores[1].error


def test_concurrency_keeps_order(endpoints):
    items = _items(9)
    scores = _client(endpoints, "ok", batch_size=2, max_concurrency=4).score(items)
    assert [s.uid for s in scores] == [i.uid for i in items]
    assert [s.reward for s in scores] == pytest.approx([(k + 1) / 10 for k in range(9)])


def test_reward_set_combines_by_weight(endpoints):
    rs = RewardSet(
        _client(endpoints, "ok"),
        [("rlhf", 0.5, _client(endpoints, "openrlhf", protocol="openrlhf"))],
    )
    s = rs.score(_items(1))[0]
    assert s.reward == pytest.approx(0.1 + 0.5 * 1.0)
    assert s.details["rlhf"] == 1.0
    bad = RewardSet(
        None, [("dead", 1.0, _client(f"http://127.0.0.1:{free_port()}", "x", retries=0))]
    )
    s = bad.score(_items(1))[0]
    assert s.reward is None and s.error.startswith("dead: request failed")


def test_python_function_verl_signature():
    app = TestClient(
        create_app(
            [
                {"name": "exact", "type": "python", "function": "tests.rewards.user_rewards:exact"},
                {
                    "name": "meta",
                    "type": "python",
                    "function": "tests.rewards.user_rewards:with_details",
                    "weight": 2.0,
                },
            ]
        )
    )
    body = {
        "items": [
            {
                "uid": "a",
                "response": " 7 ",
                "ground_truth": "7",
                "metadata": {"data_source": "gsm8k"},
            }
        ]
    }
    s = app.post("/score", json=body).json()["scores"][0]
    assert s["reward"] == pytest.approx(1.0 + 2.0 * 0.25)
    assert s["details"]["meta.source"] == "gsm8k" and s["details"]["meta.n"] == 3


def test_python_function_bad_return_and_missing_module():
    app = TestClient(
        create_app(
            [{"name": "b", "type": "python", "function": "tests.rewards.user_rewards:broken"}]
        )
    )
    s = app.post("/score", json={"items": [{"uid": "a", "response": "x"}]}).json()["scores"][0]
    assert s["reward"] is None and "finite float" in s["error"]
    with pytest.raises(ValueError, match="cannot import"):
        create_app([{"name": "m", "type": "python", "function": "no_such_mod:f"}])


def test_failure_policies():
    def scored(values, groups, errors):
        scores = [
            Score(uid=f"u{i}", reward=v, error=e)
            for i, (v, e) in enumerate(zip(values, errors, strict=True))
        ]
        rollouts = [SimpleNamespace(group_id=g) for g in groups]
        return scores, rollouts

    scores, rollouts = scored(
        [1.0, None, 0.0, 1.0], ["a", "a", "b", "b"], [None, "timeout"] + [None] * 2
    )
    assert apply_failure_policy(scores, rollouts, "drop_group") == [None, None, 0.0, 1.0]
    assert apply_failure_policy(scores, rollouts, "zero") == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(RewardFailure, match="a: timeout"):
        apply_failure_policy(scores, rollouts, "fail_step")
    assert apply_failure_policy(*scored([1.0], ["a"], [None]), "fail_step") == [1.0]
    with pytest.raises(ValueError, match="1 scores for 2 rollouts"):
        apply_failure_policy(scores[:1], rollouts[:2], "zero")


def test_serve_rewards_cli(tmp_path):
    cfg = tmp_path / "rewards.yaml"
    cfg.write_text("rewards:\n  - {name: correct, type: math}\ntoken_env: T\n")
    port = free_port()
    env = {**__import__("os").environ, "T": "s3cret"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "posttrain.recipes.cli",
            "serve-rewards",
            str(cfg),
            "--port",
            str(port),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        client = RewardClient(f"http://127.0.0.1:{port}/score", token="s3cret")
        client.wait_ready(timeout_s=60, proc=proc)
        assert (
            client.score([ScoreItem(uid="a", response="\\boxed{4}", ground_truth="4")])[0].reward
            == 1.0
        )
        assert httpx.get(f"http://127.0.0.1:{port}/openapi.json").status_code == 200
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    cfg.write_text("rewards:\n  - {name: x, type: http, url: 'http://h/score'}\n")
    bad = subprocess.run(
        [sys.executable, "-m", "posttrain.recipes.cli", "serve-rewards", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "http endpoints" in bad.stderr
