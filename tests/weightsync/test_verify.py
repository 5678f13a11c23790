"""Proof of delivery (weightsync/verify.py): one flipped element on the wire or in an
engine's load, and an adapter that was loaded but is not served, stop the push naming
the engine and the tensor; for the 'hf' engine (its held tensors) and the 'vllm' engine
(what it handed to its loader), through the worker's real receive path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.weightsync import (
    Delivery,
    DeliveryError,
    PushSource,
    TransportSettings,
    WeightHandle,
    WeightSyncError,
    check_delivery,
    fingerprint,
    make_transport,
    publish,
    push,
)
from posttrain.weightsync.verify import copy_fingerprint
from tests.engine_host import requires_vllm

FLIPPED = "model.layers.0.mlp.up_proj.weight"


def _perturbed(model_path, dtype=torch.float32, seed=1) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    sd = {
        k: (v + 0.01 * torch.randn(v.shape, generator=g)).to(dtype)
        for k, v in model.state_dict().items()
    }
    sd.pop("lm_head.weight")  # tied: the learner leaves the alias out
    return sd


def _flip(t: torch.Tensor, index: int = 5) -> torch.Tensor:
    """`t` with the lowest bit of element `index` flipped (a new tensor)."""
    bits = {2: torch.int16, 4: torch.int32}[t.element_size()]
    out = t.clone()
    out.reshape(-1).view(bits)[index] ^= 1
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_flipped_bit_changes_the_fingerprint(dtype):
    t = torch.randn(64, 33).to(dtype)
    assert fingerprint(t) == fingerprint(t.clone())
    assert fingerprint(_flip(t, 2000)) != fingerprint(t)
    assert fingerprint(t.reshape(33, 64)) != fingerprint(t)  # the shape counts too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (7,), (1100, 1000), (3, 5)])
def test_copy_fingerprint_copies_and_equals_a_separate_fingerprint(dtype, shape):
    # (1100, 1000) bf16 is 2,200,000 bytes: two whole 1 MiB chunks and a part.
    t = torch.randn(shape).to(dtype)
    if shape == (3, 5):
        t = torch.randn(5, 3).to(dtype).t()  # not contiguous
    dst = torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)
    assert copy_fingerprint(dst, t) == fingerprint(t)
    assert torch.equal(dst, t.contiguous().reshape(-1).view(torch.uint8))
    assert copy_fingerprint(dst, _flip(t, 0) if t.numel() else t) == fingerprint(
        _flip(t, 0) if t.numel() else t
    )
    with pytest.raises(ValueError, match="copy_fingerprint: 3 bytes for a"):
        copy_fingerprint(torch.zeros(3, dtype=torch.uint8), torch.zeros(8))


def _learner_push(transport, weights, version, meta=None):
    """Learner rank 0's side of one verified push: (handle, the learner's Delivery)."""
    items = list(
        publish(
            transport,
            PushSource(iter(weights.items()), None, meta or {}),
            version,
            sender=True,
            verify=True,
        )
    )
    handle, sent = items
    assert handle.meta["verify"] is True and isinstance(sent, Delivery)
    return handle, sent


def _hf_worker(model, tmp_path, lora_rank=None):
    settings = TransportSettings("filesystem", directory=str(tmp_path / "w"))
    return RolloutWorker(
        0, EngineSettings("hf", str(model), "float32", lora_rank=lora_rank), settings, 1
    )


def _flip_on_the_wire(worker, name=FLIPPED):
    receive = worker.transport.receive

    def flipped(handle):
        for n, t in receive(handle):
            yield n, (_flip(t) if n == name else t)

    worker.transport.receive = flipped


def test_hf_push_is_proven_and_a_flip_on_the_wire_is_caught(tiny_model, tmp_path):
    w = _hf_worker(tiny_model, tmp_path)
    sender = make_transport(w.transport_settings)
    weights = _perturbed(tiny_model)
    handle, sent = _learner_push(sender, weights, 1)
    assert w.update_weights(handle) == 1
    got = w.delivery()
    assert got.where == "holds" and set(got.fingerprints) == set(weights)
    check_delivery(sent, got, 0)  # no error

    _flip_on_the_wire(w)
    handle, sent = _learner_push(sender, _perturbed(tiny_model, seed=2), 2)
    w.update_weights(handle)
    with pytest.raises(
        DeliveryError, match=f"rollout engine 0: tensor '{FLIPPED}' of policy_version 2 differs"
    ):
        check_delivery(sent, w.delivery(), 0)


def test_engine_computes_no_whole_state_checksum(tiny_model, tmp_path, monkeypatch):
    # The SHA-256 of every pushed byte cost each engine ~0.25 s per 269 MB push beside
    # the per-tensor proof of delivery (xxh3): one proof is kept.
    import posttrain.weightsync.base as base

    digested: list[str] = []
    digest = base.tensor_digest
    monkeypatch.setattr(base, "tensor_digest", lambda n, t: digested.append(n) or digest(n, t))
    w = _hf_worker(tiny_model, tmp_path)
    sender = make_transport(w.transport_settings)
    handle, _ = _learner_push(sender, _perturbed(tiny_model), 1)
    assert not hasattr(handle, "checksum") and w.update_weights(handle) == 1
    assert digested == []


def test_hf_flip_inside_the_engines_load_is_caught(tiny_model, tmp_path):
    # The tensors handed to the engine are right; its copy is not: only a check of
    # what it holds sees that.
    w = _hf_worker(tiny_model, tmp_path)
    load = w.engine.load_weights

    def bad_load(stream, version=None):
        names = load(stream, version)
        p = dict(w.engine.model.named_parameters())["model.norm.weight"]
        with torch.no_grad():
            p.copy_(_flip(p))
        return names

    w.engine.load_weights = bad_load
    handle, sent = _learner_push(make_transport(w.transport_settings), _perturbed(tiny_model), 1)
    w.update_weights(handle)
    with pytest.raises(DeliveryError, match="tensor 'model.norm.weight' of policy_version 1"):
        check_delivery(sent, w.delivery(), 0)


def _lora(model_path):
    """Adapter tensors (non-zero B) and LoraConfig dict for the tiny model."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
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
    return adapter, config


_REQ = PromptRequest("g", [{"role": "user", "content": "1+2="}])
_SAMPLING = SamplingSettings(n=1, max_new_tokens=4, temperature=1.0, seed=0)


def test_hf_adapter_loaded_but_not_applied_is_caught(tiny_model, tmp_path):
    w = _hf_worker(tiny_model, tmp_path, lora_rank=8)
    adapter, config = _lora(tiny_model)
    sender = make_transport(w.transport_settings)
    handle, sent = _learner_push(sender, adapter, 1, {"adapter_config": config})
    w.update_weights(handle)
    got = w.delivery()
    assert got.active_adapter == 1 and got.where == "holds"
    check_delivery(sent, got, 0)
    w.generate([_REQ], _SAMPLING, 1)  # serves the adapter: fine

    load = w.engine.load_adapter

    def loads_but_disables(stream, cfg, version):
        names = load(stream, cfg, version)
        w.engine.model.disable_adapter_layers()  # e.g. a stale `with disable_adapter()`
        return names

    w.engine.load_adapter = loads_but_disables
    handle, sent = _learner_push(sender, adapter, 2, {"adapter_config": config})
    w.update_weights(handle)
    with pytest.raises(
        DeliveryError,
        match="rollout engine 0: the adapter of policy_version 2 "
        "was loaded but its next generate request would run with no adapter",
    ):
        check_delivery(sent, w.delivery(), 0)
    with pytest.raises(
        WeightSyncError,
        match="rollout worker 0: the adapter of policy_version 2 "
        "was pushed, but this request would run with no adapter",
    ):
        w.generate([_REQ], _SAMPLING, 2)


def test_hf_bf16_adapter_push_is_proven(tiny_model, tmp_path):
    """The learner casts the adapter to the engine's dtype (learner/push.py); peft held
    it in float32, so every push to a bf16 'hf' engine failed its proof (the
    fingerprint covers the dtype)."""
    settings = TransportSettings("filesystem", directory=str(tmp_path / "w"))
    engine = EngineSettings("hf", str(tiny_model), "bfloat16", lora_rank=8)
    w = RolloutWorker(0, engine, settings, 1)
    adapter, config = _lora(tiny_model)
    bf16 = {k: v.to(torch.bfloat16) for k, v in adapter.items()}
    for version in (1, 2):
        handle, sent = _learner_push(
            make_transport(settings), bf16, version, {"adapter_config": config}
        )
        w.update_weights(handle)
        check_delivery(sent, w.delivery(), 0)
    w.generate([_REQ], _SAMPLING, 2)  # a bf16 adapter samples on the bf16 base


@ray.remote(num_cpus=0)
class _Learner:
    def publish_weights(self, version: int, full: bool = False, fresh: bool = False):
        yield WeightHandle(version, None, 10, meta={"verify": True})
        yield Delivery(version, {"a": "1111", "b": "2222"})


@ray.remote(num_cpus=0)
class _Engine:
    def __init__(self, b: str):
        self.b = b

    def update_weights(self, handle, step=-1):
        return handle.version

    def delivery(self):
        return Delivery(3, {"a": "1111", "b": self.b}, where="holds")


def test_push_compares_every_engine_and_names_the_bad_one(ray_local):
    engines = [_Engine.remote("2222"), _Engine.remote("9999")]
    with pytest.raises(
        DeliveryError, match=r"rollout engine 1: tensor 'b' of policy_version 3 differs"
    ):
        push([_Learner.remote()], engines, 3, timeout_s=30)
    handle = push([_Learner.remote()], engines[:1], 3, timeout_s=30)
    assert handle.version == 3


def test_the_controller_does_not_retry_a_failed_delivery(monkeypatch):
    # A corrupting engine must stop the run, not be hidden by push_weights' retry.
    from posttrain.recipes import controller

    calls = []

    def bad_push(*args, **kwargs):
        calls.append(kwargs)
        raise DeliveryError("rollout engine 0: tensor 'b' of policy_version 3 differs")

    monkeypatch.setattr(controller, "push", bad_push)
    roles = SimpleNamespace(learners=[], rollout=[])
    recipe = SimpleNamespace(weight_sync=SimpleNamespace(timeout_s=5))
    with pytest.raises(DeliveryError, match="tensor 'b'"):
        controller.push_weights(roles, recipe, 3)
    assert len(calls) == 1


# -- vLLM: what it was handed to its loader ------------------------------------------------


class _Planted(RolloutWorker):
    """A vLLM worker whose transport flips one element, or whose adapter is dropped."""

    def flip_on_the_wire(self, name: str) -> None:
        _flip_on_the_wire(self, name)

    def unregister_adapter(self) -> None:
        self.engine.llm.llm_engine.remove_lora(self.engine.lora.lora_int_id)


@pytest.mark.vllm
@requires_vllm
def test_vllm_flip_on_the_wire_and_a_dropped_adapter_are_caught(
    ray_local, tiny_model_vllm, tmp_path
):
    settings = TransportSettings("filesystem", directory=str(tmp_path / "v"))
    worker = ray.remote(num_cpus=0)(_Planted).remote(
        0, EngineSettings("vllm", str(tiny_model_vllm), "float32", lora_rank=8), settings, 1
    )
    sender = make_transport(settings)
    try:
        weights = _perturbed(tiny_model_vllm)
        handle, sent = _learner_push(sender, weights, 1)
        assert ray.get(worker.update_weights.remote(handle)) == 1
        got = ray.get(worker.delivery.remote())
        assert got.where == "loaded"
        check_delivery(sent, got, 0)

        adapter, config = _lora(tiny_model_vllm)
        handle, sent = _learner_push(sender, adapter, 2, {"adapter_config": config})
        ray.get(worker.update_weights.remote(handle))
        check_delivery(sent, ray.get(worker.delivery.remote()), 0)
        ray.get(worker.unregister_adapter.remote())
        with pytest.raises(
            WeightSyncError,
            match="adapter of policy_version 2 was pushed, but "
            "this request would run with no adapter",
        ):
            ray.get(worker.generate.remote([_REQ], _SAMPLING, 2))

        ray.get(worker.flip_on_the_wire.remote("model.layers.1.self_attn.o_proj.weight"))
        handle, sent = _learner_push(sender, _perturbed(tiny_model_vllm, seed=3), 3)
        ray.get(worker.update_weights.remote(handle))
        with pytest.raises(
            DeliveryError,
            match="rollout engine 0: tensor "
            "'model.layers.1.self_attn.o_proj.weight' of policy_version 3 differs",
        ):
            check_delivery(sent, ray.get(worker.delivery.remote()), 0)
    finally:
        ray.kill(worker)
