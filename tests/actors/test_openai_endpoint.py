"""A black-box agent (a plain httpx client) drives a rollout worker's OpenAI-compatible
endpoint through a multi-call episode; the recorded calls become one token-exact
trajectory whose model tokens the learner scores exactly as the engine did."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.recipes.algo.rollouts import rollout_batch
from posttrain.recipes.episodes.agent import AgentEpisodeError, agent_rollout
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("oai") / "m", hidden=64, max_positions=1024)
    w = RolloutWorker(
        0,
        EngineSettings(kind="hf", model_path=str(folder), dtype="float32"),
        "object_store",
        threads=1,
    )
    w.version = 4  # as after four pushes
    yield w, folder
    w.close()


def _agent(url: str, episode: str) -> list[str]:
    """Three calls: ask, feed back a tool result, ask again; then the reward."""
    history = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+2?"}]
    replies = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for k, (role, content) in enumerate([("tool", "4"), ("user", "sure?"), (None, None)]):
            body = {
                "model": "policy",
                "messages": history,
                "max_tokens": 6,
                "temperature": 0.8,
                "seed": k,
            }
            r = http.post("/chat/completions", json=body, headers={"X-Episode-Id": episode})
            r.raise_for_status()
            msg = r.json()["choices"][0]["message"]
            replies.append(msg["content"])
            history = [*history, msg] + ([{"role": role, "content": content}] if role else [])
        http.post(f"/episodes/{episode}/reward", json={"reward": 0.75}).raise_for_status()
    return replies


def test_agent_episode_is_token_exact(worker):
    w, folder = worker
    url = w.serve_openai()
    assert w.serve_openai() == url  # started once
    replies = _agent(url, "ep-1")
    record = w.pop_episode("ep-1")
    calls = record["calls"]
    assert len(calls) == 3 and record["reward"] == 0.75 and record["restarts"] == 0
    for prev, nxt in zip(calls, calls[1:], strict=False):  # the sampled ids reused as is
        full = prev["prompt_ids"] + prev["completion_ids"]
        assert nxt["prompt_ids"][: len(full)] == full
    assert all(c["policy_version"] == 4 for c in calls)
    tok = w.engine.tokenizer
    r = agent_rollout("ep-1", "g", record, lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert r.response_text == replies[-1] and r.metadata["environment_reward"] == 0.75
    assert [t["role"] for t in r.turns] == [
        "assistant",
        "environment",
        "assistant",
        "environment",
        "assistant",
    ]
    assert "<|im_start|>tool\n4<|im_end|>" in tok.decode(r.turns[1]["ids"])
    batch = rollout_batch([r], [1.0], pad_id=tok.pad_token_id)
    learner = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = sequence_logprobs(
            learner, batch.input_ids, batch.attention_mask, batch.response_start, 0.8
        )
    m = batch.response_mask.bool()
    assert int(m.sum()) == sum(len(c["completion_ids"]) for c in calls)
    torch.testing.assert_close(lp[m], batch.inference_logprobs[m], rtol=0, atol=1e-4)
    assert w.pop_episode("ep-1") is None  # popped


def test_rewritten_history_restarts_the_chain(worker):
    w, _ = worker
    url = w.serve_openai()
    with httpx.Client(base_url=url, timeout=60) as http:
        for content in ("first", "second"):  # the second call does not extend the first
            body = {
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 3,
                "episode_id": "ep-2",
            }
            http.post("/chat/completions", json=body).raise_for_status()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        missing = http.post("/chat/completions", json=body)
        assert missing.status_code == 400 and "X-Episode-Id" in missing.text
    record = w.pop_episode("ep-2")
    assert record["restarts"] == 1
    tok = w.engine.tokenizer
    r = agent_rollout("ep-2", "g", record, tok.decode)
    assert r.metadata["dropped_calls"] == 1 and r.prompt_ids == record["calls"][1]["prompt_ids"]
    with pytest.raises(AgentEpisodeError, match="made no call"):
        agent_rollout("nope", "g", w.pop_episode("nope"), tok.decode)
