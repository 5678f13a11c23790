"""The `judge` reward component against a local OpenAI-compatible stub server (FastAPI
under uvicorn in a thread): request shape, bearer token, score parsing, retries, and
failures (timeout, no score) that reach the item as `reward: null`."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.testclient import TestClient

from posttrain.common.net import free_port
from posttrain.config.rewards import JudgeReward
from posttrain.rewards.judge import JudgeError, JudgeScorer, parse_score
from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.service import create_app

TOKEN = "judge-secret"


def _stub() -> tuple[FastAPI, list[dict]]:
    """Replies 'Score: <len(response)>' unless the response asks for trouble."""
    app, seen = FastAPI(), []
    flaky = {"left": 1}

    @app.post("/v1/chat/completions")
    async def chat(request: Request, authorization: str | None = Header(None)) -> dict:
        if authorization != f"Bearer {TOKEN}":
            raise HTTPException(status_code=401, detail="bad token")
        body = await request.json()
        seen.append(body)
        text = body["messages"][-1]["content"]
        if "SLOW" in text:
            await asyncio.sleep(6.0)  # past timeout_s; other requests go on meanwhile
        if "FLAKY" in text and flaky["left"] > 0:
            flaky["left"] -= 1
            raise HTTPException(status_code=503, detail="warming up")
        reply = (
            "I cannot judge this."
            if "NOSCORE" in text
            else f"Reasoning...\nScore: {text.count('!')}"
        )
        return {
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": reply},
                }
            ],
        }

    return app, seen


@pytest.fixture(scope="module")
def judge_server():
    app, seen = _stub()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", seen
    server.should_exit = True
    thread.join(timeout=10)


def _component(url: str, **kw) -> dict:
    return {
        "name": "judge",
        "type": "judge",
        "url": url,
        "model": "stub-judge",
        "token_env": "JUDGE_TOKEN",
        "template": "Q: {question}\nA: {response}",
        "system_prompt": "You grade answers.",
        "retries": 1,
        "timeout_s": 2.0,
        "score_range": [0, 10],
        **kw,
    }


def test_parse_score_last_match_and_range():
    pattern = JudgeReward.model_fields["score_pattern"].default
    assert parse_score("Score: 3 ... on reflection, Score: 8", pattern, None) == 8.0
    assert parse_score("score = 7.5", pattern, (0.0, 10.0)) == pytest.approx(0.75)
    with pytest.raises(JudgeError, match="no score"):
        parse_score("no number here", pattern, None)
    with pytest.raises(JudgeError, match="outside"):
        parse_score("Score: 11", pattern, (0.0, 10.0))


def test_schema_rejects_bad_pattern_and_range():
    with pytest.raises(ValueError, match="no group"):
        JudgeReward(name="j", type="judge", url="http://x/v1", model="m", score_pattern=r"\d+")
    with pytest.raises(ValueError, match="low < high"):
        JudgeReward(name="j", type="judge", url="http://x/v1", model="m", score_range=(5, 1))


def test_unset_token_env_fails_at_start(monkeypatch):
    monkeypatch.delenv("JUDGE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="JUDGE_TOKEN"):
        JudgeScorer(JudgeReward(**_component("http://127.0.0.1:1/v1")))


def test_judge_through_the_service(judge_server, monkeypatch):
    url, seen = judge_server
    monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
    app = create_app([_component(url, weight=2.0)], workers=2)
    items = [
        {
            "uid": "a",
            "prompt": "raw",
            "response": "great!!!!",
            "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Hi?"}],
        },
        {"uid": "b", "prompt": "Why?", "response": "ok"},
        {"uid": "flaky", "prompt": "Why?", "response": "FLAKY!!"},  # 503 once, then retried
        {"uid": "slow", "prompt": "Why?", "response": "SLOW"},  # past timeout_s, twice
        {"uid": "none", "prompt": "Why?", "response": "NOSCORE"},
    ]
    with TestClient(app) as client:
        got = {s["uid"]: s for s in client.post("/score", json={"items": items}).json()["scores"]}
    assert got["a"]["reward"] == pytest.approx(2.0 * 0.4)  # weight 2 × (4 / 10)
    assert got["a"]["details"]["judge"] == pytest.approx(0.4)
    assert "Score: 4" in got["a"]["details"]["judge.reply"]
    assert got["b"]["reward"] == 0.0
    assert got["flaky"]["reward"] == pytest.approx(2.0 * 0.2)
    assert got["slow"]["reward"] is None and "Timeout" in got["slow"]["error"]
    assert got["none"]["reward"] is None and "no score" in got["none"]["error"]
    first = next(b for b in seen if "great" in b["messages"][-1]["content"])
    assert first["model"] == "stub-judge" and first["temperature"] == 0.0
    assert first["messages"][0] == {"role": "system", "content": "You grade answers."}
    assert first["messages"][1]["content"] == "Q: Hi?\nA: great!!!!"  # last user message


def test_wrong_token_is_not_retried(judge_server, monkeypatch):
    url, seen = judge_server
    monkeypatch.setenv("JUDGE_TOKEN", "wrong")
    before = len(seen)
    scorer = JudgeScorer(JudgeReward(**_component(url, retries=3)), backoff_s=0.0)
    with pytest.raises(JudgeError, match="401"):
        scorer(ScoreItem(uid="u", prompt="p", response="r"))
    assert len(seen) == before  # refused before the stub recorded it
