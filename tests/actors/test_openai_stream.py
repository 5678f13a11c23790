"""The endpoint as verifiers 0.4's chat harness uses it: `stream: true` through the
OpenAI SDK answers the text the engine sampled (and recorded), and a posted reward
carries its components (each a reward component of the sample) or the agent's error
(the sample fails naming it)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from posttrain.recipes.episodes.agent import agent_rollout
from posttrain.recipes.episodes.step import add_environment_rewards
from posttrain.rewards.protocol import Score


@pytest.fixture(scope="module")
def worker(hf_worker):
    w, _ = hf_worker
    return w, w.serve_openai("127.0.0.1", 0, 6, 0.9)


def _decode(w):
    return lambda ids: w.engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_streamed_call_is_the_recorded_sample(worker):
    w, url = worker
    client = OpenAI(base_url=url, api_key="x", default_headers={"X-Episode-Id": "sse-1"})
    stream = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "2+2?"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    usage = chunks[-1].usage
    (call,) = w.pop_episode("sse-1")["calls"]
    assert text == _decode(w)(call["completion_ids"])
    assert finish[-1] == call["finish_reason"]
    assert usage.completion_tokens == len(call["completion_ids"])
    assert usage.prompt_tokens == len(call["prompt_ids"])


def _served(url: str, episode: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    httpx.post(f"{url}/chat/completions", json=body, headers={"X-Episode-Id": episode}, timeout=60)


def test_reward_components_become_reward_details(worker):
    w, url = worker
    _served(url, "sse-2")
    got = httpx.post(
        f"{url}/episodes/sse-2/reward",
        json={"reward": 0.5, "components": {"correct": 1.0, "short": -0.5}},
    )
    assert got.status_code == 200, got.text
    r = agent_rollout("sse-2", "g", w.pop_episode("sse-2"), _decode(w))
    (s,) = add_environment_rewards([r], [Score(uid="sse-2", reward=0.0)])
    assert s.reward == 0.5
    assert s.details == {"correct": 1.0, "short": -0.5, "environment": 0.5}


def test_non_finite_component_is_refused_and_fails_the_episode(worker):
    w, url = worker
    _served(url, "sse-3")
    got = httpx.post(
        f"{url}/episodes/sse-3/reward",
        content='{"reward": 1.0, "components": {"correct": NaN}}',
        headers={"content-type": "application/json"},
    )
    assert got.status_code == 400 and got.json()["error"]["param"] == "components.correct"
    r = agent_rollout("sse-3", "g", w.pop_episode("sse-3"), _decode(w))
    (s,) = add_environment_rewards([r], [Score(uid="sse-3", reward=0.0)])
    assert s.reward is None and "components.correct" in s.error


def test_agent_error_fails_only_that_episode(worker):
    w, url = worker
    _served(url, "sse-4")
    got = httpx.post(f"{url}/episodes/sse-4/reward", json={"error": "rubric raised KeyError"})
    assert got.status_code == 200, got.text
    r = agent_rollout("sse-4", "g", w.pop_episode("sse-4"), _decode(w))
    (s,) = add_environment_rewards([r], [Score(uid="sse-4", reward=0.0)])
    assert s.reward is None and "sse-4" in s.error and "rubric raised KeyError" in s.error
