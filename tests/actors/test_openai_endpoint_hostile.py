"""Hostile requests to the OpenAI-compatible agent endpoint (actors/openai_server.py):
malformed fields get a 400 naming the field (never a bare 500), a prompt longer than
the engine takes gets a 400 naming `messages` and the limit before the engine sees it,
rewards must be finite and belong to an episode that was served, and the episode store
is bounded."""

from __future__ import annotations

import time

import httpx
import pytest

from posttrain.actors.engine import EngineSettings, Sample
from posttrain.actors.openai_server import EpisodeRecorder, create_app
from posttrain.actors.worker import RolloutWorker
from posttrain.recipes.episodes.agent import agent_rollout
from posttrain.recipes.episodes.step import add_environment_rewards
from posttrain.rewards.protocol import Score
from tests.tiny_model import build_tiny_model

CONTEXT = 1024  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    folder = build_tiny_model(
        tmp_path_factory.mktemp("oai_h") / "m", hidden=64, max_positions=CONTEXT
    )
    w = RolloutWorker(
        0, EngineSettings(kind="hf", model_path=str(folder), dtype="float32"), "object_store", 1
    )
    yield w
    w.close()


@pytest.fixture(scope="module")
def http(worker):
    with httpx.Client(base_url=worker.serve_openai(), timeout=60) as client:
        yield client


def _chat(http, episode="e", **body):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    return http.post("/chat/completions", json=body, headers={"X-Episode-Id": episode})


BAD = {
    "messages": {"messages": []},
    "max_tokens": {"max_tokens": -5},
    "max_completion_tokens": {"max_completion_tokens": 0},
    "top_p": {"top_p": -1},
    "temperature": {"temperature": -0.5},
    "seed": {"seed": 2**70},
    "stop": {"stop": [""]},
    "n": {"n": 0},
}


@pytest.mark.parametrize("field", sorted(BAD))
def test_malformed_field_gets_a_400_naming_it(http, field):
    r = _chat(http, **BAD[field])
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and field in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_empty_stop_string_alone_and_a_bad_message_get_400(http):
    assert _chat(http, stop="").status_code == 400
    r = _chat(http, messages=[{"content": "no role"}])
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["param"]


def test_a_good_call_still_works(http, worker):
    r = _chat(http, episode="good", seed=-3, stop=["\n\n"], top_p=0.9)
    assert r.status_code == 200, r.text
    assert worker.pop_episode("good")["calls"]


def test_a_300k_character_prompt_is_refused_before_the_engine(http, worker):
    t0 = time.monotonic()
    r = _chat(http, episode="long", messages=[{"role": "user", "content": "x" * 300_000}])
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages" and str(CONTEXT) in msg, msg
    assert took < 30, took  # never sampled (the HF engine took over 150 s on it)
    assert worker.pop_episode("long") is None  # nothing recorded


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "1e39"])
def test_non_finite_reward_is_refused_and_fails_the_episode(http, worker, literal):
    episode = f"nf-{literal}"
    assert _chat(http, episode=episode).status_code == 200
    r = http.post(
        f"/episodes/{episode}/reward",
        content=f'{{"reward": {literal}}}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reward", r.text
    record = worker.pop_episode(episode)
    assert record["reward"] is None
    tok = worker.engine.tokenizer
    rollout = agent_rollout(episode, "g", record, tok.decode)
    (s,) = add_environment_rewards([rollout], [Score(uid=episode, reward=0.0)])
    assert s.reward is None and episode in s.error and "finite" in s.error, s


def test_a_finite_reward_after_a_refused_one_counts(http, worker):
    assert _chat(http, episode="again").status_code == 200
    bad = http.post(
        "/episodes/again/reward",
        content='{"reward": NaN}',
        headers={"Content-Type": "application/json"},
    )
    assert bad.status_code == 400
    assert http.post("/episodes/again/reward", json={"reward": 0.5}).status_code == 200
    record = worker.pop_episode("again")
    assert record["reward"] == 0.5 and record.get("reward_error") is None


def test_rewards_for_unknown_episodes_are_refused_and_do_not_pile_up(http, worker):
    before = len(worker.recorder.episodes)
    for k in range(300):
        r = http.post(f"/episodes/never-{k}/reward", json={"reward": 1.0})
        assert r.status_code == 404 and f"never-{k}" in r.json()["error"]["message"], r.text
    assert len(worker.recorder.episodes) == before


# --- the app on a scripted engine -----------------------------------------------------


def _app(worker, context, recorder=None):
    seen = []

    def generate(ids, sampling):
        seen.append((len(ids), sampling.max_new_tokens))
        return Sample([worker.engine.stop_ids[0]], [-0.1], "stop"), 0

    app = create_app(
        generate, worker.engine.tokenizer, recorder or EpisodeRecorder(), context_tokens=context
    )
    return app, seen


def test_a_prompt_that_fits_gets_what_is_left_of_the_context(worker):
    from fastapi.testclient import TestClient

    app, seen = _app(worker, context=64)
    with TestClient(app) as client:
        body = {"messages": [{"role": "user", "content": "x" * 20}], "max_tokens": 500}
        assert client.post(
            "/v1/chat/completions", json=body, headers={"X-Episode-Id": "a"}
        ).is_success
        body["messages"][0]["content"] = "x" * 100
        r = client.post("/v1/chat/completions", json=body, headers={"X-Episode-Id": "b"})
    (prompt, limit) = seen[0]
    assert prompt + limit == 64 and len(seen) == 1  # capped to fit; the long one refused
    assert r.status_code == 400 and "64" in r.json()["error"]["message"]


def test_the_episode_store_is_bounded_oldest_out():
    rec = EpisodeRecorder(max_episodes=3)
    for k in range(5):
        rec.get(f"e{k}")
    assert list(rec.episodes) == ["e2", "e3", "e4"]
    rec.get("e2")  # used again: now the newest
    rec.get("e5")
    assert list(rec.episodes) == ["e4", "e2", "e5"]
    assert rec.find("e0") is None and rec.find("e4") is not None
    with pytest.raises(ValueError, match="max_episodes"):
        EpisodeRecorder(max_episodes=0)


def test_generate_ids_refuses_a_prompt_over_the_context(worker):
    from posttrain.actors.rollout import SamplingSettings

    with pytest.raises(ValueError, match=r"prompt 1 .*1024"):
        worker.generate_ids([[5, 6], [5] * 2000], SamplingSettings(n=1, max_new_tokens=4), 0)
