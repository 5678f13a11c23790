"""The direct load of vLLM's CPU backend (actors/vllm_direct.py) builds the same kernels
as vLLM's layerwise reload, bit for bit, and refuses what it cannot load whole."""

from __future__ import annotations

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import SamplingSettings
from tests.engine_host import VLLMProbe, requires_vllm

pytestmark = [pytest.mark.vllm, requires_vllm]


def _weights(model_path, dtype, seed, scale=0.05) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint plus noise, in the engine's dtype, tied head left out (as learners
    send it)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [
        (k, (v + scale * torch.randn(v.shape, generator=g)).to(dtype))
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    ]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_direct_load_builds_the_kernels_vllms_reload_builds(ray_local, tiny_model_vllm, dtype):
    probe = ray.remote(num_cpus=0)(VLLMProbe).remote(
        EngineSettings("vllm", str(tiny_model_vllm), dtype)
    )
    try:
        assert ray.get(probe.direct_loader.remote()) == (True, None)
        first = _weights(tiny_model_vllm, getattr(torch, dtype), seed=1)
        other = _weights(tiny_model_vllm, getattr(torch, dtype), seed=2)
        sampling = SamplingSettings(n=2, max_new_tokens=12, temperature=1.0, seed=3)
        prompt = [[5, 6, 7, 8, 9]]

        ray.get(probe.load_with_reload.remote(first))
        reloaded = ray.get(probe.kernel_outputs.remote())
        sampled = ray.get(probe.call.remote("generate", prompt, sampling))

        ray.get(probe.call.remote("load_weights", other))  # direct, different values
        assert not torch.equal(
            ray.get(probe.kernel_outputs.remote())["lm_head"], reloaded["lm_head"]
        )
        ray.get(probe.call.remote("load_weights", first))  # direct, back again
        _same(ray.get(probe.kernel_outputs.remote()), reloaded)
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

        class Qwen2ForCausalLM(torch.nn.Module):  # a real name, not in ARCHITECTURES yet
            pass

        loader, why = DirectLoader.build(Qwen2ForCausalLM(), set(), lora=False, tp=1)
        return loader is None, why

    unused, why = ray.get(build.remote())
    assert unused and "Qwen2ForCausalLM is not among" in why
