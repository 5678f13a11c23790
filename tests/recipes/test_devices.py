"""`resources.device: cuda` and the GPU keys: accepted by the schema on any machine,
checked against this machine's torch at run start (recipes/cluster.py)."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import RecipeError, ResourcesConfig
from posttrain.config.recipe import Recipe
from posttrain.learner.distributed import (
    backend_for,
    cuda_memory,
    format_cuda_memory,
    rank_device,
)
from posttrain.recipes.cluster import check_local_cuda


def _recipe(**over) -> dict:
    base = {
        "name": "t",
        "algorithm": "grpo",
        "model": {"path": "m"},
        "data": {"train": {"generator": "arithmetic", "size": 4}},
        "rollout": {"engine": "vllm"},
        "rewards": [{"name": "c", "type": "math"}],
        "train": {"steps": 1, "prompts_per_step": 1},
    }
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value}
    return base


def test_schema_accepts_cuda_and_gpu_keys():
    r = Recipe.model_validate(
        _recipe(
            resources={
                "device": "cuda",
                "colocate": True,
                "rollout": {"gpus": 2},
                "learner": {"gpus": 2},
            },
            train={"gradient_checkpointing": True},
            rollout={"vllm": {"gpu_memory_utilization": 0.3}},
            weight_sync={"type": "cuda_ipc"},
        )
    )
    assert r.resources.device == "cuda" and r.train.gradient_checkpointing
    assert r.rollout.vllm.gpu_memory_utilization == 0.3
    tp = Recipe.model_validate(
        _recipe(resources={"device": "cuda", "rollout": {"gpus": 4, "gpus_per_engine": 2}})
    )
    assert tp.resources.rollout.gpus_per_engine == 2


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"resources": {"rollout": {"gpus": 2, "gpus_per_engine": 2}}},
            "set resources.device: cuda",
        ),
        (
            {
                "resources": {
                    "device": "cuda",
                    "colocate": True,
                    "rollout": {"gpus": 2, "gpus_per_engine": 2},
                }
            },
            "colocate: false",
        ),
        (
            {
                "resources": {"device": "cuda", "rollout": {"gpus": 2, "gpus_per_engine": 2}},
                "rollout": {"engine": "hf"},
            },
            "only rollout.engine: vllm",
        ),
        (
            {"weight_sync": {"type": "cuda_ipc"}},
            "needs resources.device: cuda and resources.colocate",
        ),
        (
            {
                "resources": {"device": "cuda", "rollout": {"gpus": 2, "gpus_per_engine": 2}},
                "weight_sync": {"type": "collective"},
            },
            "set weight_sync.type: object_store",
        ),
        (
            {
                "resources": {"device": "cuda", "colocate": True},
                "weight_sync": {"type": "collective"},
            },
            "set weight_sync.type: cuda_ipc",
        ),
        (
            {
                "resources": {
                    "device": "cuda",
                    "colocate": True,
                    "rollout": {"gpus": 2},
                    "learner": {"gpus": 2},
                },
                "model": {"adapter": {"type": "lora"}},
                "weight_sync": {"type": "cuda_ipc"},
            },
            "reaches only the engine on learner rank 0's GPU",
        ),
        ({"rollout": {"vllm": {"gpu_memory_utilization": 1.5}}}, "less than or equal to 1"),
    ],
)
def test_gpu_keys_refused_with_the_fix(over, message):
    with pytest.raises(ValueError, match=message):
        Recipe.model_validate(_recipe(**over))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only torch")
def test_cuda_colocate_on_cpu_torch_is_caught_at_run_start():
    res = ResourcesConfig.model_validate({"device": "cuda", "colocate": True})
    with pytest.raises(
        RecipeError,
        match=r"resources.device is 'cuda' with colocated engines.*"
        r"sees no CUDA GPU.*resources.device: cpu",
    ):
        check_local_cuda(res)
    with pytest.raises(RuntimeError, match="sees no GPU"):
        rank_device("cuda")
    check_local_cuda(ResourcesConfig())  # cpu: nothing to check


def test_backend_and_memory_per_device():
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="resources.device 'tpu'"):
        backend_for("tpu")
    assert rank_device("cpu") == torch.device("cpu") and cuda_memory(torch.device("cpu")) == {}
    assert format_cuda_memory({}) == ""
    line = format_cuda_memory(
        {"cuda_allocated_mb": 10.4, "cuda_reserved_mb": 20.0, "cuda_peak_mb": 30.6}
    )
    assert line == ("learner CUDA memory (rank 0): allocated 10 MiB, reserved 20 MiB, peak 31 MiB")
