"""The direct load of vLLM's CPU backend (actors/vllm_direct.py) builds the same kernels
as vLLM's layerwise reload, bit for bit, and refuses what it cannot load whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import SamplingSettings
from tests.engine_host import VLLMProbe, requires_vllm
from tests.tiny_model import build_tiny_model

pytestmark = [pytest.mark.vllm, requires_vllm]


def _weights(model_path, dtype, seed, scale=0.05) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint plus noise, in the engine's dtype, a tied head left out (as learners
    send it)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    g = torch.Generator().manual_seed(seed)
    return [
        (k, (v + scale * torch.randn(v.shape, generator=g)).to(dtype))
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    ]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def models(tiny_model_vllm, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama (tied head), a Qwen2 (q/k/v biases, its own head) and a Qwen3
    (q and k norms, tied), each at head_dim 32."""
    root = tmp_path_factory.mktemp("direct")
    return {
        "llama": tiny_model_vllm,
        "qwen2": build_tiny_model(root / "qwen2", hidden=128, arch="qwen2", tied=False),
        "qwen3": build_tiny_model(root / "qwen3", hidden=128, arch="qwen3"),
    }


@pytest.mark.parametrize(
    "arch, dtype",
    [
        ("llama", "bfloat16"),
        # slow: float32 and qwen2 take the same kernel-building path as the two kept
        pytest.param("llama", "float32", marks=pytest.mark.slow),
        pytest.param("qwen2", "bfloat16", marks=pytest.mark.slow),
        ("qwen3", "bfloat16"),
    ],
)
def test_direct_load_builds_the_kernels_vllms_reload_builds(ray_local, models, arch, dtype):
    model = models[arch]
    probe = ray.remote(num_cpus=0)(VLLMProbe).remote(EngineSettings("vllm", str(model), dtype))
    try:
        assert ray.get(probe.direct_loader.remote()) == (True, None)
        first = _weights(model, getattr(torch, dtype), seed=1)
        other = _weights(model, getattr(torch, dtype), seed=2)
        sampling = SamplingSettings(n=2, max_new_tokens=12, temperature=1.0, seed=3)
        prompt = [[5, 6, 7, 8, 9]]

        # The engine holds other values before each load, so a piece either load skipped
        # would keep them and differ.
        ray.get(probe.load_with_reload.remote(other))
        held = ray.get(probe.kernel_outputs.remote())
        ray.get(probe.call.remote("load_weights", first))  # direct
        direct = ray.get(probe.kernel_outputs.remote())
        sampled = ray.get(probe.call.remote("generate", prompt, sampling))
        assert all(not torch.equal(held[k], direct[k]) for k in direct)

        ray.get(probe.load_with_reload.remote(other))
        ray.get(probe.load_with_reload.remote(first))
        _same(direct, ray.get(probe.kernel_outputs.remote()))
        again = ray.get(probe.call.remote("generate", prompt, sampling))
        assert [[s.token_ids for s in g] for g in again] == [
            [s.token_ids for s in g] for g in sampled
        ]
        assert [[s.logprobs for s in g] for g in again] == [
            [s.logprobs for s in g] for g in sampled
        ]
    finally:
        ray.kill(probe)


def test_direct_load_refuses_a_wrong_shape_and_a_layer_left_half_loaded(ray_local, tiny_model_vllm):
    probe = ray.remote(num_cpus=0)(VLLMProbe).remote(
        EngineSettings("vllm", str(tiny_model_vllm), "float32")
    )
    try:
        good = _weights(tiny_model_vllm, torch.float32, seed=1)
        bad = [(n, t[:-1] if n.endswith("k_proj.weight") else t) for n, t in good]
        with pytest.raises(ray.exceptions.RayTaskError, match=r"k_proj.weight.*has shape"):
            ray.get(probe.call.remote("load_weights", bad))

        # A stream (names not known up front) that leaves out one layer's v_proj.
        fresh = ray.remote(num_cpus=0)(VLLMProbe).remote(
            EngineSettings("vllm", str(tiny_model_vllm), "float32")
        )
        try:
            short = [(n, t) for n, t in good if n != "model.layers.0.self_attn.v_proj.weight"]
            with pytest.raises(ray.exceptions.RayTaskError, match=r"qkv_proj.*only some"):
                ray.get(fresh.load_stream.remote(short))
            # and the engine refuses to sample from half-loaded weights afterwards
            with pytest.raises(ray.exceptions.RayTaskError, match="restart this engine"):
                ray.get(
                    fresh.call.remote("generate", [[5, 6]], SamplingSettings(n=1, max_new_tokens=2))
                )
        finally:
            ray.kill(fresh)
    finally:
        ray.kill(probe)


def test_direct_load_is_off_where_asked_and_with_lora(ray_local, tiny_model_vllm):
    off = ray.remote(num_cpus=0)(VLLMProbe).remote(
        EngineSettings("vllm", str(tiny_model_vllm), "float32", direct_load=False)
    )
    lora = ray.remote(num_cpus=0)(VLLMProbe).remote(
        EngineSettings("vllm", str(tiny_model_vllm), "float32", lora_rank=8)
    )
    try:
        assert ray.get(off.attr.remote("direct")) is None
        used, why = ray.get(lora.direct_loader.remote())
        assert not used and "LoRA" in why
    finally:
        ray.kill(off)
        ray.kill(lora)


def test_an_architecture_not_tested_against_the_reload_keeps_the_reload(ray_local):
    @ray.remote(num_cpus=0)
    def build():
        from posttrain.actors.vllm_direct import DirectLoader

        class MistralForCausalLM(torch.nn.Module):  # a real name, not in ARCHITECTURES yet
            pass

        loader, why = DirectLoader.build(MistralForCausalLM(), set(), lora=False, tp=1)
        return loader is None, why

    unused, why = ray.get(build.remote())
    assert unused and "MistralForCausalLM is not among" in why
