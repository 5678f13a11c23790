"""Object-store weight transport: exact round trip, checksums, tied embeddings, and a
rollout worker that refuses weights it cannot verify."""

from __future__ import annotations

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings
from posttrain.actors.hf_engine import HFEngine
from posttrain.actors.worker import RolloutWorker
from posttrain.weightsync import TransportSettings, WeightSyncError, make_transport, state_checksum


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _perturbed_weights(model_path, dtype) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    sd = {
        k: (v + 0.01 * torch.randn(v.shape, generator=g)).to(dtype)
        for k, v in model.state_dict().items()
    }
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied, as the learner sends
    return sd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact(ray_local, dtype):
    t = make_transport("object_store")
    sent = {"a": torch.randn(3, 4).to(dtype), "b": torch.arange(5, dtype=torch.float32).to(dtype)}
    handle = t.send(sent, version=3)
    got = dict(t.receive(handle))
    assert handle.version == 3 and handle.num_bytes == sum(
        v.numel() * v.element_size() for v in sent.values()
    )
    for k, v in sent.items():
        assert got[k].dtype == dtype and torch.equal(got[k], v)
    assert state_checksum(got.items()) == state_checksum(sent.items())


def test_checksum_sees_one_changed_element():
    a = {"w": torch.zeros(10)}
    b = {"w": torch.zeros(10)}
    b["w"][7] = 1e-7
    assert state_checksum(a.items()) != state_checksum(b.items())


def test_engine_holds_exactly_what_was_pushed_including_tied_head(ray_local, tiny_model):
    engine = HFEngine(str(tiny_model), dtype="float32")
    sent = _perturbed_weights(tiny_model, torch.float32)
    handle = make_transport("object_store").send(sent, version=1)
    names = engine.load_weights(make_transport("object_store").receive(handle))
    held = engine.named_weights()
    assert state_checksum((n, held[n]) for n in names) == state_checksum(sent.items())
    # the output layer reflects the new embedding (tied weights)
    assert torch.equal(engine.model.lm_head.weight, sent["model.embed_tokens.weight"])


def test_worker_acknowledges_version_and_stays_on_it_after_a_failed_load(ray_local, tiny_model):
    Worker = ray.remote(num_cpus=0, num_gpus=0)(RolloutWorker)
    w = Worker.remote(
        0, EngineSettings("hf", str(tiny_model), "float32"), TransportSettings("object_store"), 1
    )
    sent = _perturbed_weights(tiny_model, torch.float32)
    handle = make_transport("object_store").send(sent, version=1)
    assert ray.get(w.update_weights.remote(handle, 0)) == 1
    assert ray.get(w.weights_checksum.remote(sorted(sent))) == state_checksum(sent.items())
    wrong = {**sent, "model.norm.weight": torch.zeros(3)}  # a wrong shape: the load fails
    bad = make_transport("object_store").send(wrong, version=2)
    with pytest.raises(WeightSyncError, match="rollout worker 0.*policy_version 2"):
        ray.get(w.update_weights.remote(bad, 1))
    assert ray.get(w.policy_version.remote()) == 1  # stays visibly on the old version
    ray.kill(w)
