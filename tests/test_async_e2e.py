"""Asynchronous GRPO (`train.max_staleness`) end to end on a tiny random model with the
HF engine: no sample trains beyond k policy versions, and each keeps its version in
the rollout files."""

from __future__ import annotations

import json

import pytest

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from tests.test_grpo_e2e import _grpo_recipe


@pytest.mark.parametrize(("algorithm", "k"), [("grpo", 1), ("grpo", 2), ("ppo", 1)])
def test_no_sample_trains_beyond_k_versions(tiny_model, tmp_path, algorithm, k):
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        algorithm=algorithm,
        train={
            "steps": 4,
            "prompts_per_step": 2,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "max_staleness": k,
            "correction": {"mode": "tis", "cap": 2.0},
        },
    )
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


def _prompts_of(run_dir, step):
    rows = (run_dir / "rollouts" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return sorted({json.loads(x)["prompt_text"] for x in rows})


def test_resume_generates_the_in_flight_samples_again(tiny_model, tmp_path):
    from posttrain.recipes import checkpoints

    train = {
        "steps": 4,
        "prompts_per_step": 2,
        "micro_batch_size": 2,
        "lr": 1e-3,
        "max_staleness": 1,
    }
    straight = tmp_path / "straight"
    straight.mkdir()
    run(load_recipe(_grpo_recipe(straight, tiny_model, train=train)), straight / "run")
    split = tmp_path / "split"
    split.mkdir()
    recipe_file = _grpo_recipe(split, tiny_model, train={**train, "steps": 2})
    run(load_recipe(recipe_file), split / "run")  # checkpoint after 2 steps; round 2 in flight
    latest = checkpoints.latest(split / "run")
    history = run(load_recipe(recipe_file, ["train.steps=4"]), split / "run", resume=latest)

    assert [m["policy_version"] for m in history] == [3, 4]
    for step in (2, 3):  # the same prompts as the straight run: none skipped
        assert _prompts_of(split / "run", step) == _prompts_of(straight / "run", step)
    resumed = [json.loads(x) for x in (split / "run" / "rollouts" / "step_00002.jsonl").open()]
    assert all(r["policy_version"] == 2 for r in resumed)  # regenerated under the checkpoint


def test_partial_rollouts_tag_versions_and_counts_add_up(tiny_model, tmp_path):
    """`rollout.partial`: pushes land while the engine generates (a threaded worker);
    every saved sample carries one version per token, non-decreasing, its
    `policy_version` the oldest; staleness counts from it; the sample totals add up."""
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rollout={"engine": "hf", "samples_per_prompt": 4, "max_new_tokens": 64, "partial": True},
        train={
            "steps": 4,
            "prompts_per_step": 2,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "max_staleness": 1,
        },
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    assert [m["policy_version"] for m in history] == [1, 2, 3, 4]
    for m in history:
        assert m["staleness_max"] <= 1 and m["samples_dropped"] == 0
        assert m["staleness_frac/0"] + m["staleness_frac/1"] == pytest.approx(1.0)
        assert 1.0 <= m["versions_spanned_mean"] <= m["versions_spanned_max"] <= 2.0
        assert m["samples_generated_total"] == (
            m["samples_trained_total"] + m["samples_dropped_total"] + m["samples_waiting"]
        )
    assert history[-1]["samples_trained_total"] == 4 * 8
    for step in range(4):
        saved = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open()]
        assert len(saved) == 8
        for r in saved:
            v = r["policy_versions"]
            assert len(v) == len(r["response_ids"]) and v == sorted(v)
            assert r["policy_version"] == v[0] and 0 <= step - v[0] <= 1
