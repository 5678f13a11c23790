"""Adapter-only weight sync: an engine serving base + a pushed LoRA adapter samples
with the same logprobs as an engine given the merged weights (fp32, 1e-4), for the
'hf' and 'vllm' engines, through the worker's real transport path."""

from __future__ import annotations

import dataclasses

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.weightsync import TransportSettings, make_transport
from tests.engine_host import requires_vllm

KINDS = ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, requires_vllm])]
TOL = 1e-4
RANK = 8


@pytest.fixture(scope="module")
def trained_lora(tiny_model_vllm):
    """A LoRA with non-zero B (as after training): (adapter tensors, config, merged)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base = AutoModelForCausalLM.from_pretrained(tiny_model_vllm, dtype=torch.float32)
    cfg = LoraConfig(
        r=RANK,
        lora_alpha=16,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    adapter = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    config = {
        k: sorted(v) if isinstance(v, set) else getattr(v, "value", v)
        for k, v in model.peft_config["default"].to_dict().items()
    }
    merged = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    return adapter, config, merged


def _worker(kind, model, lora_rank=None):
    Worker = ray.remote(num_cpus=0)(RolloutWorker)
    return Worker.remote(
        0,
        EngineSettings(kind, str(model), "float32", lora_rank=lora_rank),
        TransportSettings("object_store"),
        1,
    )


def _sample(w, temperature=0.7):
    req = PromptRequest("g", [{"role": "user", "content": "12+30="}])
    s = SamplingSettings(n=3, max_new_tokens=12, temperature=temperature, seed=4)
    return ray.get(w.generate.remote([req], s, 0))


def _reference(model_path, weights, r, temperature=0.7):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    ids = torch.tensor([r.prompt_ids + r.response_ids])
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, torch.ones_like(ids), len(r.prompt_ids), temperature)
    return lp[0, len(r.prompt_ids) :]


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_push_matches_merged_push(ray_local, tiny_model_vllm, trained_lora, kind):
    adapter, config, merged = trained_lora
    t = make_transport("object_store")
    by_adapter, by_merged = _worker(kind, tiny_model_vllm, RANK), _worker(kind, tiny_model_vllm)
    try:
        h = t.send(adapter, version=1)
        h = dataclasses.replace(h, meta={"adapter_config": config})
        assert ray.get(by_adapter.update_weights.remote(h, 0)) == 1
        assert (
            ray.get(
                by_merged.update_weights.remote(
                    make_transport("object_store").send(merged, version=1), 0
                )
            )
            == 1
        )
        a, m = _sample(by_adapter), _sample(by_merged)
        for ra, rm in zip(a, m, strict=True):
            ref = _reference(tiny_model_vllm, merged, ra)
            torch.testing.assert_close(torch.tensor(ra.inference_logprobs), ref, rtol=0, atol=TOL)
            if ra.response_ids == rm.response_ids:  # same seed: usually the same tokens
                torch.testing.assert_close(
                    torch.tensor(ra.inference_logprobs),
                    torch.tensor(rm.inference_logprobs),
                    rtol=0,
                    atol=TOL,
                )
        assert any(ra.response_ids == rm.response_ids for ra, rm in zip(a, m, strict=True))
        # The next version replaces the adapter (not stacked on the old one).
        zero = {k: torch.zeros_like(v) for k, v in adapter.items()}
        h2 = dataclasses.replace(t.send(zero, version=2), meta={"adapter_config": config})
        assert ray.get(by_adapter.update_weights.remote(h2, 1)) == 2
        base = AutoModelForCausalLM.from_pretrained(tiny_model_vllm).state_dict()
        for r in _sample(by_adapter):
            torch.testing.assert_close(
                torch.tensor(r.inference_logprobs),
                _reference(tiny_model_vllm, base, r),
                rtol=0,
                atol=TOL,
            )
    finally:
        ray.kill(by_adapter)
        ray.kill(by_merged)
