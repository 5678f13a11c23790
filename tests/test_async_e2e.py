"""Asynchronous GRPO (`train.max_staleness`) end to end on a tiny random model with the
HF engine: no sample trains beyond k policy versions, and each keeps its version in
the rollout files."""

from __future__ import annotations

import json

import pytest

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from tests.test_grpo_e2e import _grpo_recipe


@pytest.mark.parametrize("k", [1, 2])
def test_no_sample_trains_beyond_k_versions(tiny_model, tmp_path, k):
    recipe_file = _grpo_recipe(
        tmp_path, tiny_model,
        train={"steps": 4, "prompts_per_step": 2, "micro_batch_size": 2, "lr": 1e-3,
               "max_staleness": k, "correction": {"mode": "tis", "cap": 2.0}})
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    assert [m["policy_version"] for m in history] == [1, 2, 3, 4]
    for m in history:
        assert 0 <= m["staleness_max"] <= k and m["dropped_stale"] == 0
        assert 0.0 <= m["rollout_idle_fraction"] <= 1.0
        assert 0.0 <= m["learner_idle_fraction"] <= 1.0
        assert m["is_weight_mean"] > 0 and 0 <= m["is_corrected_fraction"] <= 1
        assert m["mismatch_kl_k3"] >= 0 and m["mismatch_abs"] >= 0
    # Generation ran ahead: later steps train on samples of an older policy.
    assert max(m["staleness_max"] for m in history[1:]) >= 1
    for step in range(4):
        saved = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open()]
        assert len(saved) == 8  # 2 groups of 4
        assert all(0 <= step - r["policy_version"] <= k for r in saved)
        assert len({r["group_id"] for r in saved}) == 2
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness_max"] for m in lines] == [m["staleness_max"] for m in history]
