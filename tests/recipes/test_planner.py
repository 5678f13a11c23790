"""`posttrain plan`: model sizes from config.json, flags that name the key, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.planning import formulas as plan
from posttrain.recipes.planning.planner import Cluster, ModelShape, plan_recipe, trained_tokens
from tests.conftest import ROOT

QUICK = ROOT / "recipes" / "quickstart_grpo.yaml"
#: The hand values below are the quickstart's on 2 learner ranks (it leaves the layout
#: to the run, whose prediction depends on the machine).
PIN2 = ["resources.learner.gpus=2"]
SMOLLM2 = ModelShape(
    layers=30,
    hidden=576,
    heads=9,
    kv_heads=3,
    head_dim=64,
    intermediate=1536,
    vocab=49152,
    tied=True,
)
LLAMA3_70B = ModelShape(
    layers=80,
    hidden=8192,
    heads=64,
    kv_heads=8,
    head_dim=128,
    intermediate=28672,
    vocab=128256,
    tied=False,
)


def test_parameter_counts_match_the_published_models():
    assert SMOLLM2.params == 134_515_008
    assert LLAMA3_70B.params == 70_553_706_496
    assert plan.broadcast_bytes(LLAMA3_70B.params) / 1e9 == pytest.approx(141, abs=0.25)
    # LoRA r=16 on q,k,v,o,gate,up,down: 30 × 16 × Σ(in + out)
    per_layer = 16 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
    assert (
        SMOLLM2.lora_params(
            16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        == 30 * per_layer
    )


def test_quickstart_fits_and_70b_is_flagged_with_the_key():
    r = load_recipe(QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"])
    small = plan_recipe(r, SMOLLM2, "h100", prompt_tokens=31)
    assert small.flags == []
    assert small.learner_memory["weights+grads+AdamW (16 B/param, FSDP)"] == 16 * SMOLLM2.params / 2
    assert small.engine_memory["KV cache (32 seqs x 55 tokens)"] == 23040 * 32 * 55
    assert small.times.step == pytest.approx(
        small.times.decode + small.times.train + small.times.push
    )
    big = plan_recipe(r, LLAMA3_70B, "h100", prompt_tokens=31)
    assert any("resources.learner.gpus" in f for f in big.flags)
    assert any("resources.rollout.gpus" in f for f in big.flags)  # 141 GB > 80 GB
    qlora = plan_recipe(
        load_recipe(
            QUICK,
            [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", "model.adapter.type=qlora"],
        ),
        LLAMA3_70B,
        "h200",
        prompt_tokens=31,
    )
    assert not any(f.startswith("learner") for f in qlora.flags)  # NF4 base fits


def test_best_split_moves_devices_to_the_slower_side():
    r = load_recipe(
        QUICK, [*PIN2, "rollout.engine=hf", "resources.rollout.gpus=3", "resources.learner.gpus=1"]
    )
    p = plan_recipe(r, SMOLLM2, "a100", prompt_tokens=31)
    assert p.best is not None and p.best.step <= p.times.step
    assert p.best.rollout + p.best.learner == 4


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").rglob("*.yaml")), ids=lambda p: p.name)
@pytest.mark.parametrize("gpu", sorted(plan.HARDWARE))
def test_every_shipped_recipe_plans(path, gpu):
    p = plan_recipe(load_recipe(path), SMOLLM2, gpu, prompt_tokens=64)
    assert p.flags == []  # the shipped recipes use the 135M model: all fit
    assert 0 < p.times.step < 10
    assert 0 <= p.times.decode / p.times.step <= 1


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain.recipes.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_plan_cli(tiny_model, tmp_path):
    ok = _cli(
        "plan",
        str(QUICK),
        "--gpu",
        "h200",
        "--set",
        "resources.learner.gpus=2",
        "--set",
        f"model.path={tiny_model}",
        "--set",
        "rollout.engine=hf",
    )
    assert ok.returncode == 0, ok.stderr
    for needle in (
        "memory per device on h200 (141 GB)",
        "learner idle",
        "MFU 40%",
        "recipe 1:2",
        "best",
    ):
        assert needle in ok.stdout
    bad = _cli("plan", str(QUICK), "--set", "rollout.samples_per_prompt=1")
    assert bad.returncode == 2 and "rollout.samples_per_prompt" in bad.stderr
    gpu = _cli("plan", str(QUICK), "--gpu", "tpu", "--set", f"model.path={tiny_model}")
    assert gpu.returncode == 2 and "h100" in gpu.stderr
    cold = _cli(
        "plan",
        str(QUICK),
        "--set",
        "rollout.engine=hf",
        env={**os.environ, "POSTTRAIN_CACHE": str(tmp_path / "empty")},
    )
    assert cold.returncode == 2 and "not converted yet" in cold.stderr
    assert not (tmp_path / "empty" / "models").exists()  # nothing converted


def test_nodes_set_the_devices_searched_and_the_push_link():
    c = Cluster(nodes=2, gpus_per_node=4)
    assert c.devices == 8
    # engines on devices 0..r-1, learner rank 0 on device r
    assert [c.push_crosses_nodes(r) for r in (1, 3, 4, 5)] == [False, False, True, True]
    r = load_recipe(
        QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"]
    )  # 1 rollout + 2 learner devices
    p = plan_recipe(r, SMOLLM2, "h100", prompt_tokens=31, cluster=Cluster(2, 8))
    assert p.best is not None and p.best.rollout + p.best.learner == 16
    h100 = plan.HARDWARE["h100"]
    # a broadcast is one-way: half the datasheet's 900 GB/s (both directions summed)
    assert p.times.push == 2 * SMOLLM2.params / (450 * plan.GB)
    r8 = load_recipe(
        QUICK, [*PIN2, "rollout.engine=hf", "resources.rollout.gpus=8", "resources.learner.gpus=8"]
    )
    cross = plan_recipe(r8, SMOLLM2, "h100", prompt_tokens=31, cluster=Cluster(2, 8))
    assert cross.times.cross_node
    assert cross.times.push == 2 * SMOLLM2.params / h100.network_bytes_per_s  # 50 GB/s NIC
    assert cross.flags == []


def test_nodes_flag_too_few_devices_and_engines_across_nodes():
    r = load_recipe(
        QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", "resources.rollout.gpus=3"]
    )
    # the schema refuses gpus_per_engine > 1 today (no tensor-parallel engines yet); the
    # planner already places such engines within nodes
    rollout = r.resources.rollout.model_copy(update={"gpus_per_engine": 3})
    r = r.model_copy(update={"resources": r.resources.model_copy(update={"rollout": rollout})})
    p = plan_recipe(r, SMOLLM2, "h100", prompt_tokens=31, cluster=Cluster(1, 4))
    assert any("asks for 5 devices" in f and "has 4" in f for f in p.flags)
    assert any(f.startswith("resources.rollout.gpus_per_engine: 3") for f in p.flags)
    assert p.best is None  # a 3-GPU engine cannot be placed within 4-GPU nodes twice over


def test_gpu_plan_trains_the_packed_tokens():
    """The quickstart (4 prompts × 8 samples, 31 + 24 tokens, micro-batch 16): the learner
    packs each group into 31 + 8·24 tokens, so the policy's 6·N·tokens count 892 tokens,
    not 32·55 = 1760; at micro-batch 4 a group spans 2 micro-batches and its prompt counts
    twice (4 · (2·31 + 192) = 1016)."""
    r = load_recipe(QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"])
    assert trained_tokens(r, 31, SMOLLM2.hidden, SMOLLM2.intermediate) == 4 * (31 + 8 * 24)
    assert trained_tokens(r, 31, None, None) == 32 * 55
    small_mb = load_recipe(
        QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", "train.micro_batch_size=4"]
    )
    assert trained_tokens(small_mb, 31, 576, 1536) == 4 * (2 * 31 + 8 * 24)
    p = plan_recipe(r, SMOLLM2, "h100", prompt_tokens=31)
    hw = plan.HARDWARE["h100"]
    expected = plan.compute_seconds(6 * SMOLLM2.params * 892, 2, hw.bf16_flops, p.mfu)
    assert p.times.train == pytest.approx(expected, rel=1e-12)


def test_engine_weights_and_push_in_the_recipes_dtype():
    """A float32 recipe serves and pushes 4 bytes per parameter, a bf16 one 2."""
    bf16 = plan_recipe(
        load_recipe(QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"]),
        SMOLLM2,
        "h100",
        31,
    )
    fp32 = plan_recipe(
        load_recipe(
            QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", "model.dtype=float32"]
        ),
        SMOLLM2,
        "h100",
        31,
    )
    assert bf16.engine_memory["weights (bfloat16)"] == 2 * SMOLLM2.params
    assert fp32.engine_memory["weights (float32)"] == 4 * SMOLLM2.params
    assert fp32.times.push == pytest.approx(2 * bf16.times.push, rel=1e-12)
