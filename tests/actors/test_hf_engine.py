"""The transformers engine: groups, finish reasons, and logprobs that the learner
reproduces (importance ratio 1 on unchanged weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.hf_engine import HFEngine
from actors.rollout import SamplingSettings
from learner.logprobs import sequence_logprobs


@pytest.fixture(scope="module")
def engine(tiny_model):
    return HFEngine(str(tiny_model), dtype="float32")


def test_groups_and_lengths(engine):
    prompts = [engine.tokenize_chat([{"role": "user", "content": q}]) for q in ("1+1", "22+3")]
    out = engine.generate(prompts, SamplingSettings(n=3, max_new_tokens=5, seed=1))
    assert [len(g) for g in out] == [3, 3]
    for group in out:
        for s in group:
            assert 1 <= len(s.token_ids) <= 5
            assert len(s.logprobs) == len(s.token_ids)
            ended = s.token_ids[-1] in engine.eos_ids
            assert s.finish_reason == ("stop" if ended else "length")
            assert all(lp <= 0 for lp in s.logprobs)


def test_same_seed_same_samples(engine):
    p = [engine.tokenize_chat([{"role": "user", "content": "abc"}])]
    a = engine.generate(p, SamplingSettings(n=2, max_new_tokens=6, seed=7))
    b = engine.generate(p, SamplingSettings(n=2, max_new_tokens=6, seed=7))
    assert [s.token_ids for s in a[0]] == [s.token_ids for s in b[0]]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_learner_reproduces_inference_logprobs(engine, tiny_model, temperature):
    prompt = engine.tokenize_chat([{"role": "user", "content": "7+8"}])
    sample = engine.generate([prompt], SamplingSettings(n=1, max_new_tokens=8,
                                                        temperature=temperature, seed=3))[0][0]
    learner = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        lp = sequence_logprobs(learner, ids, torch.ones_like(ids), len(prompt), temperature)
    ratio = torch.exp(lp[0, len(prompt):] - torch.tensor(sample.logprobs))
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)


def test_load_weights_rejects_unknown_and_partial(engine):
    own = engine.named_weights()
    with pytest.raises(ValueError, match="not a parameter"):
        engine.load_weights([("nope.weight", torch.zeros(1))])
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="would keep old values"):
        engine.load_weights([(name, own[name].clone())])
