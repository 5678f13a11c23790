"""What a checkpoint keeps of the samples in flight (`RolloutWorker.inflight_prefixes`,
actors/worker_inflight.py) and how a resume continues them: each saved prefix comes
back bitwise (tokens, logprobs, versions) at the head of its sample, the rest is
sampled from prompt + prefix with the budget left."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings, Sample
from posttrain.actors.partial import PartialSample, PushGate, generate_partial
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.weightsync import TransportSettings
from tests.actors.test_partial_rollouts import ScriptedEngine

PROMPTS = [
    PromptRequest("s0-p0", [{"role": "user", "content": "12+30?"}]),
    PromptRequest("s0-p1", [{"role": "user", "content": "7*6?"}]),
]
SAMPLING = SamplingSettings(n=2, max_new_tokens=16, temperature=1.0, seed=11)


def _worker(model, tmp_path) -> RolloutWorker:
    return RolloutWorker(
        0,
        EngineSettings(kind="hf", model_path=str(model), dtype="float32", seed=7),
        TransportSettings(type="filesystem", directory=str(tmp_path / "weights")),
        threads=1,
        partial=True,
    )


def _killed_run(model, tmp_path):
    """A worker generating PROMPTS whose samples in flight are read after the 8th
    token step (`inflight_prefixes` from another thread, as a checkpoint does); returns
    what it read and the Rollouts the run went on to produce."""
    w = _worker(model, tmp_path)
    forward, calls, read = w.engine.model.forward, [0], []

    def counting_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 8:
            t = threading.Thread(target=lambda: read.append(w.inflight_prefixes()))
            t.start()
            read.append(t)
        return forward(*args, **kwargs)

    w.engine.model.forward = counting_forward
    rollouts = w.generate(PROMPTS, SAMPLING, 0)
    read[0].join(timeout=60)
    assert w._inflight_rows() == {}  # a finished request leaves the registry
    return read[1], rollouts


def test_a_resume_continues_the_saved_prefixes_bitwise(tiny_model, tmp_path):
    saved, killed = _killed_run(tiny_model, tmp_path / "a")
    saved = json.loads(json.dumps(saved))  # through the checkpoint's JSON
    assert sorted(saved) == ["s0-p0", "s0-p1"]
    half = [s for row in saved.values() for s in row]
    assert len(half) == 4 and all(not s["done"] and 0 < len(s["token_ids"]) < 16 for s in half)
    # what was read is what the killed run had sampled (and went on from)
    for r in killed:
        s = saved[r.group_id][int(r.uid.rsplit("-", 1)[1])]
        n = len(s["token_ids"])
        assert r.response_ids[:n] == s["token_ids"]
        assert r.inference_logprobs[:n] == s["logprobs"]  # bitwise
        assert s["versions"] == [0] * n

    resumed = [PromptRequest(p.group_id, p.messages, prefixes=saved[p.group_id]) for p in PROMPTS]
    w = _worker(tiny_model, tmp_path / "b")
    calls = []
    forward = w.engine.model.forward
    w.engine.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    w.version = 3  # the resumed run's policy: the continuation is tagged with it
    out = w.generate(resumed, SAMPLING, 3)

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for r in out:
        s = saved[r.group_id][int(r.uid.rsplit("-", 1)[1])]
        n = len(s["token_ids"])
        assert r.response_ids[:n] == s["token_ids"]
        assert r.inference_logprobs[:n] == s["logprobs"]  # bitwise, floats through JSON
        assert r.policy_versions == [0] * n + [3] * (len(r.response_ids) - n)
        assert r.policy_version == 0  # staleness counts from the oldest token
        assert len(r.response_ids) == 16 or r.finish_reason == "stop"
        # the continuation is sampled from prompt + prefix (fp32, same kernels: 1e-4)
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
        want = logits.log_softmax(-1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
        assert r.inference_logprobs[n:] == pytest.approx(want[n:].tolist(), abs=1e-4)
    # only the budget left was generated: fewer forward passes than a fresh 16 tokens
    left = max(16 - len(s["token_ids"]) for row in saved.values() for s in row)
    assert len(calls) <= left + 1


def test_finished_prefixes_come_back_without_the_engine():
    engine = ScriptedEngine([])
    done = PartialSample([5, 6], [-0.5, -0.25], [2, 2], "stop", True)
    out = generate_partial(
        engine,
        [[9]],
        SamplingSettings(n=1, max_new_tokens=4),
        PushGate(),
        threading.Lock(),
        lambda: 3,
        out=[[PartialSample.from_dict(done.to_dict())]],
    )
    assert out[0][0] == done and engine.calls == []


def test_a_saved_prefix_is_continued_with_the_budget_left():
    engine = ScriptedEngine([[Sample([7, 8], [-0.7, -0.8], "length")]])
    half = PartialSample([5, 6], [-0.5, -0.25], [1, 2])
    out = generate_partial(
        engine,
        [[9]],
        SamplingSettings(n=1, max_new_tokens=4, seed=40),
        PushGate(),
        threading.Lock(),
        lambda: 3,
        out=[[half]],
    )
    s = out[0][0]
    assert (s.token_ids, s.logprobs, s.versions) == (
        [5, 6, 7, 8],
        [-0.5, -0.25, -0.7, -0.8],
        [1, 2, 3, 3],
    )
    prompts, rest = engine.calls[0]  # no fresh first segment: the continuation at once
    assert prompts == [[9, 5, 6]] and (rest.n, rest.max_new_tokens, rest.seed) == (1, 2, 41)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"logprobs": [-0.1]}, "2 tokens, 1 logprobs"),
        ({"logprobs": [-0.1, math.nan]}, "non-finite"),
        ({"versions": [0]}, "1 versions"),
    ],
)
def test_a_malformed_saved_prefix_is_refused(bad, says):
    d = {"token_ids": [1, 2], "logprobs": [-0.1, -0.2], "versions": [0, 0]}
    d |= {"finish_reason": "length", "done": False, **bad}
    with pytest.raises(ValueError, match=says):
        PartialSample.from_dict(d)


def test_a_worker_without_a_push_gate_cannot_hand_over_its_samples(tiny_model, tmp_path):
    w = RolloutWorker(
        0,
        EngineSettings(kind="hf", model_path=str(tiny_model), dtype="float32", seed=7),
        TransportSettings(type="filesystem", directory=str(tmp_path / "weights")),
        threads=1,
        partial=False,
    )
    assert w.inflight_prefixes() is None
