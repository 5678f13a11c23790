"""`posttrain plan`: model sizes from config.json, flags that name the key, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from posttrain.recipes import plan
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.planner import ModelShape, plan_recipe
from tests.conftest import ROOT

QUICK = ROOT / "recipes" / "quickstart_grpo.yaml"
SMOLLM2 = ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
                     intermediate=1536, vocab=49152, tied=True)
LLAMA3_70B = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                        intermediate=28672, vocab=128256, tied=False)


def test_parameter_counts_match_the_published_models():
    assert SMOLLM2.params == 134_515_008
    assert LLAMA3_70B.params == 70_553_706_496
    assert plan.broadcast_bytes(LLAMA3_70B.params) / 1e9 == pytest.approx(141, abs=0.25)
    # LoRA r=16 on q,k,v,o,gate,up,down: 30 × 16 × Σ(in + out)
    per_layer = 16 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
    assert SMOLLM2.lora_params(16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]) == 30 * per_layer


def test_quickstart_fits_and_70b_is_flagged_with_the_key():
    r = load_recipe(QUICK, ["rollout.engine=hf"])
    small = plan_recipe(r, SMOLLM2, "h100", prompt_tokens=31)
    assert small.flags == []
    assert small.learner_memory["weights+grads+AdamW (16 B/param, FSDP)"] == \
        16 * SMOLLM2.params / 2
    assert small.engine_memory["KV cache (32 seqs x 55 tokens)"] == 23040 * 32 * 55
    assert small.times.step == pytest.approx(
        small.times.decode + small.times.train + small.times.push)
    big = plan_recipe(r, LLAMA3_70B, "h100", prompt_tokens=31)
    assert any("resources.learner.gpus" in f for f in big.flags)
    assert any("resources.rollout.gpus" in f for f in big.flags)  # 141 GB > 80 GB
    qlora = plan_recipe(load_recipe(QUICK, ["rollout.engine=hf", "model.adapter.type=qlora"]),
                        LLAMA3_70B, "h200", prompt_tokens=31)
    assert not any(f.startswith("learner") for f in qlora.flags)  # NF4 base fits


def test_best_split_moves_devices_to_the_slower_side():
    r = load_recipe(QUICK, ["rollout.engine=hf", "resources.rollout.gpus=3",
                            "resources.learner.gpus=1"])
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
    return subprocess.run([sys.executable, "-m", "posttrain.recipes.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


def test_plan_cli(tiny_model, tmp_path):
    ok = _cli("plan", str(QUICK), "--gpu", "h200", "--set", f"model.path={tiny_model}",
              "--set", "rollout.engine=hf")
    assert ok.returncode == 0, ok.stderr
    for needle in ("memory per device on h200 (141 GB)", "learner idle", "MFU 40%",
                   "recipe 1:2", "best"):
        assert needle in ok.stdout
    bad = _cli("plan", str(QUICK), "--set", "rollout.samples_per_prompt=1")
    assert bad.returncode == 2 and "rollout.samples_per_prompt" in bad.stderr
    gpu = _cli("plan", str(QUICK), "--gpu", "tpu", "--set", f"model.path={tiny_model}")
    assert gpu.returncode == 2 and "h100" in gpu.stderr
    cold = _cli("plan", str(QUICK), "--set", "rollout.engine=hf",
                env={**os.environ, "POSTTRAIN_CACHE": str(tmp_path / "empty")})
    assert cold.returncode == 2 and "not converted yet" in cold.stderr
    assert not (tmp_path / "empty" / "models").exists()  # nothing converted
