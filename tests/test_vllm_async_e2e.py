"""GRPO end to end on vLLM's AsyncLLM engine (`rollout.vllm.async_engine`) on a tiny
random model: synchronous, the learner reproduces the engine's logprobs after each push
(the weights reach the engine core's process); asynchronous with partial rollouts,
pushes land while the engine generates and every saved sample carries one version per
token, non-decreasing, with the sample totals adding up."""

from __future__ import annotations

import pytest

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from tests.engine_host import requires_vllm
from tests.test_async_e2e import FOUR_STEPS_K1, check_counts_and_versions
from tests.test_grpo_e2e import _grpo_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm]
ROLLOUT = {"engine": "vllm", "vllm": {"async_engine": True}, "samples_per_prompt": 4}


def test_two_grpo_steps_reproduce_the_engines_logprobs(tiny_model_vllm, tmp_path):
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model_vllm,
        rollout={**ROLLOUT, "max_new_tokens": 6},
        # a random model's 6 characters hold a digit about half the time: groups differ
        rewards=[{"name": "digit", "type": "format", "pattern": "[0-9]"}],
        train={"steps": 2, "prompts_per_step": 4, "micro_batch_size": 4, "lr": 1e-3},
    )
    history = run(load_recipe(recipe_file), tmp_path / "run")
    assert [h["policy_version"] for h in history] == [1, 2]
    for h in history:
        assert h["failed_scores"] == 0
        assert h["logprob_mismatch"] < 1e-4  # step 1 samples from pushed weights


def test_partial_rollouts_tag_versions_and_counts_add_up(tiny_model_vllm, tmp_path):
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model_vllm,
        rollout={**ROLLOUT, "max_new_tokens": 64, "partial": True},
        train=FOUR_STEPS_K1,
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    assert [m["policy_version"] for m in history] == [1, 2, 3, 4]
    for m in history:
        assert m["staleness_max"] <= 1 and m["samples_dropped"] == 0
        assert 1.0 <= m["versions_spanned_mean"] <= m["versions_spanned_max"] <= 2.0
    check_counts_and_versions(history, run_dir, samples_per_step=8, newest_k=1, oldest_k=1)
