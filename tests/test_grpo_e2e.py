"""Two GRPO steps end to end on a tiny random model: Ray rollout worker → HTTP reward
service → 2 FSDP2 learner workers → object-store weight push (checksum-verified)."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers import AutoModelForCausalLM

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from tests.engine_host import requires_vllm


def _grpo_recipe(tmp_path, model_path, **blocks):
    """A 2-step GRPO recipe on arithmetic with math + length rewards; `blocks` replace
    whole top-level blocks."""
    recipe = {
        "name": "tiny-e2e",
        "algorithm": "grpo",
        "model": {"path": str(model_path), "dtype": "float32"},
        "data": {"train": {"generator": "arithmetic", "size": 20, "seed": 1}},
        "rollout": {"engine": "hf", "samples_per_prompt": 4, "max_new_tokens": 6},
        "rewards": [
            {"name": "correct", "type": "math"},
            {"name": "short", "type": "length", "target_chars": 3, "weight": 0.5},
        ],
        "train": {"steps": 2, "prompts_per_step": 3, "micro_batch_size": 2, "lr": 1e-3},
        "resources": {"rollout": {"gpus": 1}, "learner": {"gpus": 2}, "threads_per_worker": 1},
        "weight_sync": {"type": "object_store", "verify_checksum": True},
        "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
        **blocks,
    }
    recipe_file = tmp_path / "tiny.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    return recipe_file


@pytest.mark.parametrize(
    "colocate",
    # slow: on CPU colocated differs from split only in where Ray places the roles
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["split", "colocated"],
)
def test_two_grpo_steps(tiny_model, tmp_path, colocate):
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        grpo={"kl_coef": 0.01},
        resources={
            "rollout": {"gpus": 1},
            "learner": {"gpus": 2},
            "threads_per_worker": 1,
            "colocate": colocate,
        },
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in lines] == [1, 2] == [h["policy_version"] for h in history]
    for m in lines:
        assert m["failed_scores"] == 0
        assert 0.0 <= m["rollout_idle_fraction"] <= 1.0 and 0.0 <= m["learner_idle_fraction"] <= 1.0
        for key in ("generate", "score", "logprobs", "train", "weight_sync"):
            assert m[f"time/{key}"] >= 0.0
        assert m["kl"] >= 0.0 and m["groups_with_signal"] > 0 and m["grad_norm"] > 0.0
    assert lines[1]["kl"] > 0.0  # the policy moved away from the reference after step 0
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00001.jsonl").open()]
    assert len(saved) == 12 and all(r["policy_version"] == 1 for r in saved)
    assert all(len(r["inference_logprobs"]) == len(r["response_ids"]) for r in saved)
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert final.config.tie_word_embeddings


def test_unscorable_step_fails_loudly_and_keeps_rollouts(tiny_model, tmp_path):
    from posttrain.common.net import free_port
    from posttrain.recipes.algo.rollouts import RewardFailure

    recipe_file = tmp_path / "dead.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-dead-endpoint",
                "algorithm": "grpo",
                "model": {"path": str(tiny_model), "dtype": "float32"},
                "data": {"train": {"generator": "arithmetic", "size": 4}},
                "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
                "rewards": [
                    {
                        "name": "dead",
                        "type": "http",
                        "retries": 1,
                        "timeout_s": 2,
                        "url": f"http://127.0.0.1:{free_port()}/score",
                    }
                ],
                "on_reward_failure": "fail_step",
                "train": {"steps": 2, "prompts_per_step": 2},
                "resources": {"threads_per_worker": 1},
                "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
            }
        )
    )
    with pytest.raises(RewardFailure, match="could not be scored"):
        run(load_recipe(recipe_file), tmp_path / "run")
    saved = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_00000.jsonl").open()]
    assert len(saved) == 4 and all(r["reward"] is None for r in saved)
    assert "ConnectError" in saved[0]["reward_details"]["error"]


def test_two_ppo_steps_with_critic(tiny_model, tmp_path):
    recipe_file = tmp_path / "ppo.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-ppo",
                "algorithm": "ppo",
                "model": {"path": str(tiny_model), "dtype": "float32"},
                "data": {"train": {"generator": "arithmetic", "size": 8}},
                "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 5},
                "rewards": [{"name": "len", "type": "length", "target_chars": 3}],
                "ppo": {"epochs": 2, "mini_batches": 2, "kl_coef": 0.05, "critic_lr": 1e-3},
                "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 2, "lr": 1e-3},
                "resources": {"learner": {"gpus": 2}, "threads_per_worker": 1},
                "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
            }
        )
    )
    history = run(load_recipe(recipe_file), tmp_path / "run")
    assert [h["policy_version"] for h in history] == [1, 2]
    for h in history:
        for key in (
            "value_loss",
            "explained_variance",
            "clip_fraction",
            "value_clip_fraction",
            "kl",
            "advantage_mean",
            "advantage_std",
        ):
            assert key in h
        assert h["value_loss"] > 0 and h["grad_norm"] > 0
    # 2 epochs × 2 mini-batches: later updates see a moved policy, so the ratio leaves 1
    assert history[1]["kl"] > 0


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize(
    ("checksum", "delta"),
    # slow: deltas and fingerprints through transports: tests/weightsync test_delta, test_verify
    [(False, False), pytest.param(True, True, marks=pytest.mark.slow)],
    ids=["streamed", "delta-verified"],
)
def test_two_grpo_steps_on_vllm_with_collective_sync(tiny_model_vllm, tmp_path, checksum, delta):
    """2 vLLM engines, 2 FSDP2 ranks, weights broadcast over gloo (streamed while the
    learner gathers, unverified; or a delta push after the first, each proven by
    fingerprints); after each push the learner's old_logprobs reproduce the engines'
    inference_logprobs (fp32)."""
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model_vllm,
        rollout={"engine": "vllm", "samples_per_prompt": 4, "max_new_tokens": 6},
        # a random model's 6 characters hold a digit about half the time: groups differ
        rewards=[{"name": "digit", "type": "format", "pattern": "[0-9]"}],
        train={"steps": 2, "prompts_per_step": 4, "micro_batch_size": 4, "lr": 1e-3},
        resources={"rollout": {"gpus": 2}, "learner": {"gpus": 2}, "threads_per_worker": 1},
        weight_sync={
            "type": "collective",
            "bucket_mb": 1,
            "verify_checksum": checksum,
            "delta": delta,
        },
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)
    assert [h["policy_version"] for h in history] == [1, 2]
    if delta:  # the second push sent only what changed (lr 1e-3 moves most fp32 bits)
        assert history[0]["weight_sync_changed_fraction"] == 1.0
        assert 0 < history[1]["weight_sync_changed_fraction"] <= 1.0
    assert any(h["grad_norm"] > 0.0 for h in history)
    for h in history:
        assert h["failed_scores"] == 0
        assert h["logprob_mismatch"] < 1e-4  # step 1 samples from pushed weights
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00001.jsonl").open()]
    assert len(saved) == 16 and all(r["policy_version"] == 1 for r in saved)


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize(
    ("adapter", "transport"),
    # slow: LoRA over the object store; QLoRA over the collective carries the same push
    [pytest.param("lora", "object_store", marks=pytest.mark.slow), ("qlora", "collective")],
)
def test_adapter_only_sync_serves_the_learners_policy(
    tiny_model_vllm, tmp_path, adapter, transport
):
    """LoRA/QLoRA with `adapter_mode: adapter`: only adapter tensors travel each step
    (QLoRA's dequantised NF4 base once, as version 0), and the engine's
    inference_logprobs equal the learner's old_logprobs (fp32)."""
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model_vllm,
        model={
            "path": str(tiny_model_vllm),
            "dtype": "float32",
            "adapter": {"type": adapter, "r": 8, "alpha": 16},
        },
        rollout={"engine": "vllm", "samples_per_prompt": 4, "max_new_tokens": 6},
        rewards=[{"name": "digit", "type": "format", "pattern": "[0-9]"}],
        train={"steps": 3, "prompts_per_step": 4, "micro_batch_size": 4, "lr": 1e-2},
        weight_sync={"type": transport, "adapter_mode": "adapter", "verify_checksum": True},
    )
    history = run(load_recipe(recipe_file), tmp_path / "run")
    assert [h["policy_version"] for h in history] == [1, 2, 3]
    assert any(h["grad_norm"] > 0.0 for h in history)
    for h in history:
        assert h["logprob_mismatch"] < 1e-4
