"""Exactness of a resume (CPU, fp32, `engine: hf`, object-store pushes): 4 GRPO steps
straight, and 2 steps stopped by SIGTERM + a resume for 2 more, give bitwise-equal
losses, rewards, LRs (under warmup), samples and final weights; the logs hold each step
once even when a step after the checkpoint had been logged before a crash. PPO (critic)
and DPO (pair order) split at step 1 equal their straight runs too (marked slow)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from safetensors.torch import load_file

from posttrain.recipes import checkpoints
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import RunStopped, run
from posttrain.recipes.monitoring.log import StepLog
from tests.test_grpo_e2e import _grpo_recipe

KEYS = ("loss", "reward_mean", "lr", "grad_norm", "response_length_mean", "policy_version")


def _recipe(tmp_path, **train):
    return _grpo_recipe(
        tmp_path,
        tmp_path.parent / "model",
        rollout={"engine": "hf", "samples_per_prompt": 4, "max_new_tokens": 6, "temperature": 1.0},
        train={
            "steps": 4,
            "prompts_per_step": 3,
            "micro_batch_size": 2,
            "lr": 1e-2,
            "warmup_steps": 4,
            **train,
        },
        resources={"rollout": {"gpus": 1}, "learner": {"gpus": 2}, "threads_per_worker": 1},
        # 20 prompts, 3 a step: the stream crosses no epoch here (see test_data for that)
        weight_sync={"type": "object_store"},
    )


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rollouts(run_dir, step):
    rows = (run_dir / "rollouts" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return [
        (r["response_ids"], r["inference_logprobs"], r["reward"]) for r in map(json.loads, rows)
    ]


@pytest.fixture
def model_dir(tiny_model, tmp_path):
    (tmp_path / "model").symlink_to(tiny_model)
    return tmp_path


def test_stop_and_resume_equals_a_straight_run(model_dir, monkeypatch):
    straight_dir, stopped_dir = model_dir / "straight", model_dir / "stopped"
    straight_dir.mkdir(), stopped_dir.mkdir()
    run(load_recipe(_recipe(straight_dir)), straight_dir / "run")

    record = StepLog.record

    def sigterm_at_step_1(self, step, metrics, spans):
        record(self, step, metrics, spans)
        if step == 1:  # arrives mid-run: the step ends, a checkpoint follows, then a stop
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(StepLog, "record", sigterm_at_step_1)
    run_dir = stopped_dir / "run"
    with pytest.raises(RunStopped, match=f"posttrain run --resume {run_dir}"):
        run(load_recipe(_recipe(stopped_dir, checkpoint_every=3)), run_dir)
    monkeypatch.setattr(StepLog, "record", record)
    assert [p.name for p in checkpoints.complete(run_dir)] == ["step_00002"]
    # a crash after the checkpoint had logged step 2 already: it must not show twice
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "loss": 123.0}) + "\n")
    (run_dir / "rollouts" / "step_00002.jsonl").write_text("")

    ckpt = checkpoints.latest(run_dir)
    run(load_recipe(ckpt / "recipe.yaml"), run_dir, resume=ckpt)

    want, got = _metrics(straight_dir / "run"), _metrics(run_dir)
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    for key in KEYS:
        assert [m[key] for m in got] == [m[key] for m in want], key
    assert want[1]["lr"] < want[2]["lr"] < want[3]["lr"]  # warmup spans the resume
    for step in range(4):
        assert _rollouts(run_dir, step) == _rollouts(straight_dir / "run", step)
    spans = [json.loads(x)["step"] for x in (run_dir / "spans.jsonl").read_text().splitlines()]
    assert sorted(set(spans)) == [0, 1, 2, 3]
    a = load_file(straight_dir / "run" / "final" / "model.safetensors")
    b = load_file(run_dir / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # every 3 steps and the final one; keep_checkpoints: 2 removed step 2's
    assert [p.name for p in checkpoints.complete(run_dir)] == ["step_00003", "step_00004"]


def _split_equals_straight(make, run_dir, keys):
    """`make(steps)` straight for 2 steps vs 1 step (its final checkpoint) + a resume
    with train.steps 2: equal metrics in `keys` and equal final weights."""
    want = run(make(2), run_dir / "straight")
    first = run(make(1), run_dir / "split")
    ckpt = checkpoints.latest(run_dir / "split")
    assert checkpoints.read_state(ckpt)["step"] == 1
    rest = run(make(2), run_dir / "split", resume=ckpt)
    for key in keys:
        assert [m[key] for m in first + rest] == [m[key] for m in want], key
    a = load_file(run_dir / "straight" / "final" / "model.safetensors")
    b = load_file(run_dir / "split" / "final" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
    return ckpt


@pytest.mark.slow  # 3 PPO runs, about 85 s
def test_ppo_resume_restores_the_critic(tiny_model, tmp_path):
    import yaml

    def make(steps):
        f = tmp_path / f"ppo{steps}.yaml"
        f.write_text(
            yaml.safe_dump(
                {
                    "name": "tiny-ppo",
                    "algorithm": "ppo",
                    "model": {"path": str(tiny_model), "dtype": "float32"},
                    "data": {"train": {"generator": "arithmetic", "size": 8}},
                    "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 5},
                    "rewards": [{"name": "len", "type": "length", "target_chars": 3}],
                    "ppo": {"epochs": 2, "mini_batches": 2, "critic_lr": 1e-2},
                    "train": {
                        "steps": steps,
                        "prompts_per_step": 2,
                        "micro_batch_size": 2,
                        "lr": 1e-2,
                        "warmup_steps": 2,
                    },
                    "resources": {"learner": {"gpus": 2}, "threads_per_worker": 1},
                    "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
                }
            )
        )
        return load_recipe(f)

    # value_loss at step 1 reads the critic (and its Adam state) the checkpoint restored
    _split_equals_straight(
        make,
        tmp_path,
        ("loss", "value_loss", "explained_variance", "reward_mean", "lr", "grad_norm"),
    )


@pytest.mark.slow  # 3 DPO runs, about 85 s
def test_dpo_resume_continues_the_pair_order(tiny_model, tmp_path, monkeypatch):
    import yaml

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Q{i}: {i}+{i}?", "chosen": f" {2 * i}", "rejected": f" {i}"})
            + "\n"
            for i in range(6)
        )
    )

    def make(steps):
        f = tmp_path / f"dpo{steps}.yaml"
        f.write_text(
            yaml.safe_dump(
                {
                    "name": "tiny-dpo",
                    "algorithm": "dpo",
                    "model": {"path": str(tiny_model), "dtype": "float32"},
                    "data": {"train": {"path": str(data), "format": "pairs"}},
                    "dpo": {"beta": 0.1, "max_length": 64},
                    "train": {
                        "steps": steps,
                        "prompts_per_step": 2,
                        "micro_batch_size": 2,
                        "lr": 1e-2,
                    },
                    "resources": {"learner": {"gpus": 2}, "threads_per_worker": 1},
                    "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
                }
            )
        )
        return load_recipe(f)

    ckpt = _split_equals_straight(make, tmp_path, ("loss", "rewards/margin", "lr"))
    assert checkpoints.read_state(ckpt)["algorithm"]["ref_cache_key"]
