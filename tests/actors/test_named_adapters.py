"""Named LoRA adapters on one engine (actors/adapter_slots.py, the service's sessions),
for the 'hf' and 'vllm' engines through the worker's real push path (learner-side
`publish` with the proof of delivery, object-store transport): two adapters of
different ranks on one engine each sample what that adapter alone sampled (same seed:
same tokens, logprobs within 1e-5) and what base + that adapter merged gives (the
learner's forward, fp32, 1e-4); the base and the worker's policy_version are
untouched; the least recently used adapter is evicted when the slots are full, and a
request for an evicted, dropped or unknown name is refused naming it."""

from __future__ import annotations

import dataclasses

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import SamplingSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.weightsync import (
    Delivery,
    DeliveryError,
    PushSource,
    WeightSyncError,
    check_delivery,
    make_transport,
    publish,
)
from tests.engine_host import requires_vllm

KINDS = ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, requires_vllm])]
SAME = 1e-5  # one adapter sampled alone, then beside another, on one engine
MERGED = 1e-4  # the engine's logprobs against the learner's forward on merged weights
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAMPLING = SamplingSettings(n=1, max_new_tokens=10, temperature=0.8, seed=5)


def _lora(model_path, rank: int, seed: int, targets=TARGETS):
    """A trained-looking LoRA (non-zero B): (PEFT tensors, LoraConfig dict, merged
    state dict), alpha = rank as the service's sessions have."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    tensors = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    config = {
        k: sorted(v) if isinstance(v, set) else getattr(v, "value", v)
        for k, v in model.peft_config["default"].to_dict().items()
    }
    return tensors, config, dict(model.merge_and_unload().state_dict())


@pytest.fixture(scope="module")
def loras(tiny_model_vllm):
    return {"alice": _lora(tiny_model_vllm, 4, 1), "bob": _lora(tiny_model_vllm, 8, 2)}


@pytest.fixture(scope="module")
def prompts(tiny_model_vllm):
    tok = AutoTokenizer.from_pretrained(tiny_model_vllm)
    chats = [[{"role": "user", "content": q}] for q in ("12+30=", "hello", "7*6")]
    return [
        list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"])
        for c in chats
    ]


class _Probe(RolloutWorker):
    """Test-only: what the engine itself holds."""

    def engine_adapters(self) -> int:
        """Adapters in the engine's own store (peft's configs; vLLM's registered LoRAs,
        each with its folder)."""
        if hasattr(self.engine, "llm"):
            loras = self.engine.llm.llm_engine.list_loras()
            root = self.engine._named_root
            assert root is not None and len(list(root.iterdir())) == len(loras)
            return len(loras)
        return len(self.engine.model.peft_config)


def _worker(kind, model, max_adapters=2):
    settings = EngineSettings(kind, str(model), "float32", lora_rank=8, max_adapters=max_adapters)
    return ray.remote(num_cpus=0)(_Probe).remote(0, settings, "object_store", 1)


def _push(worker, name, lora, version) -> Delivery:
    """Learner rank 0's side of a named adapter push, then the worker's load; returns the
    learner's `Delivery`."""
    tensors, config, _ = lora
    meta = {"adapter_config": config, "adapter_name": name}
    source = PushSource(iter(tensors.items()), None, meta)
    handle, sent = publish(
        make_transport("object_store"), source, version, sender=True, verify=True
    )
    assert ray.get(worker.update_weights.remote(handle, 0)) == version
    return sent


def _sample(worker, prompts, adapter=None):
    return ray.get(worker.generate_ids.remote(prompts, SAMPLING, 0, adapter))


def _close(a, b):
    """Same tokens and logprobs within SAME, sample by sample."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=SAME
        )


def _learner_logprobs(model_path, weights, prompt, sample):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, torch.ones_like(ids), len(prompt), SAMPLING.temperature)
    return lp[0, len(prompt) :]


@pytest.mark.parametrize("kind", KINDS)
def test_two_named_adapters_each_sample_what_it_alone_samples(
    ray_local, tiny_model_vllm, loras, prompts, kind
):
    w = _worker(kind, tiny_model_vllm)
    try:
        base, _ = _sample(w, prompts)
        sent_a = _push(w, "alice", loras["alice"], 3)
        alone, version = _sample(w, prompts, "alice")
        assert version == 3
        sent_b = _push(w, "bob", loras["bob"], 7)
        (beside, _), (bob, bob_version) = _sample(w, prompts, "alice"), _sample(w, prompts, "bob")
        _close(beside, alone)
        assert bob_version == 7 and [s.token_ids for s in bob] != [s.token_ids for s in beside]
        _close(_sample(w, prompts)[0], base)  # the base is unaffected
        for name, samples in (("alice", beside), ("bob", bob)):
            merged = loras[name][2]
            for p, s in zip(prompts, samples, strict=True):
                ref = _learner_logprobs(tiny_model_vllm, merged, p, s)
                torch.testing.assert_close(torch.tensor(s.logprobs), ref, rtol=0, atol=MERGED)
        # proof of delivery, per name; the worker's policy_version is untouched
        check_delivery(sent_a, ray.get(w.delivery.remote("alice")), 0)
        check_delivery(sent_b, ray.get(w.delivery.remote("bob")), 0)
        with pytest.raises(DeliveryError, match="report is for adapter 'bob', not the pushed"):
            check_delivery(sent_a, ray.get(w.delivery.remote("bob")), 0)
        assert ray.get(w.policy_version.remote()) == 0
        assert ray.get(w.adapters.remote()) == {"alice": 3, "bob": 7}
    finally:
        ray.kill(w)


@pytest.mark.parametrize("kind", KINDS)
def test_the_least_recently_used_adapter_is_evicted_and_named_when_asked_for(
    ray_local, tiny_model_vllm, loras, prompts, kind
):
    w = _worker(kind, tiny_model_vllm)
    try:
        sent_a = _push(w, "alice", loras["alice"], 1)
        _push(w, "bob", loras["bob"], 1)
        first, _ = _sample(w, prompts, "alice")  # alice used after bob: bob is the oldest
        _push(w, "carol", loras["bob"], 2)
        assert list(ray.get(w.adapters.remote())) == ["alice", "carol"]
        assert ray.get(w.engine_adapters.remote()) == 2  # bob's memory released
        with pytest.raises(ValueError, match="'bob' was evicted .*2 adapters.*push it again"):
            _sample(w, prompts, "bob")
        with pytest.raises(ValueError, match="'dave' is not loaded on this engine"):
            _sample(w, prompts, "dave")
        _close(_sample(w, prompts, "alice")[0], first)
        # a new version of a name replaces it in its slot; the old proof no longer holds
        sent_a2 = _push(w, "alice", loras["bob"], 2)
        with pytest.raises(DeliveryError, match="for policy_version 2, not the pushed 1"):
            check_delivery(sent_a, ray.get(w.delivery.remote("alice")), 0)
        check_delivery(sent_a2, ray.get(w.delivery.remote("alice")), 0)
        _close(_sample(w, prompts, "alice")[0], _sample(w, prompts, "carol")[0])
        assert ray.get(w.drop_adapter.remote("alice")) is True
        assert ray.get(w.drop_adapter.remote("alice")) is False
        assert ray.get(w.engine_adapters.remote()) == 1
        with pytest.raises(ValueError, match="'alice' is not loaded"):
            _sample(w, prompts, "alice")
        assert ray.get(w.delivery.remote("alice")).version == -1
    finally:
        ray.kill(w)


@pytest.mark.parametrize("kind", KINDS)
def test_named_and_recipe_adapters_never_share_an_engine(ray_local, tiny_model_vllm, loras, kind):
    tensors, config, _ = loras["alice"]
    t = make_transport("object_store")
    w = _worker(kind, tiny_model_vllm)
    try:
        _push(w, "alice", loras["alice"], 1)
        if kind == "vllm":  # ranks above the engine's lora_rank (8) are refused
            with pytest.raises(WeightSyncError, match="'wide' has rank 16; .* up to 8"):
                _push(w, "wide", _lora(tiny_model_vllm, 16, 3), 2)
        recipe = dataclasses.replace(t.send(tensors, version=1), meta={"adapter_config": config})
        with pytest.raises(WeightSyncError, match="holds named adapters \\['alice'\\]"):
            ray.get(w.update_weights.remote(recipe, 0))
    finally:
        ray.kill(w)
