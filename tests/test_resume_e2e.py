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


def test_a_damaged_checkpoint_deletes_nothing_and_stops_every_role(model_dir, monkeypatch):
    """Real checkpoints (DCP shards): a resume whose learner set-up fails on a truncated
    shard keeps the logs of the steps after the checkpoint and stops the local reward
    service it started; the CLI finds the damage first (exit 2 naming the file, the
    previous whole checkpoint offered), and refuses a data file replaced in place by one
    of the same size (exit 2 naming it)."""
    from typer.testing import CliRunner

    from posttrain.recipes import loop
    from posttrain.recipes.cli import app
    from posttrain.recipes.roles import handles as role_handles

    work = model_dir / "w"
    work.mkdir()
    data = work / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
            for i in range(1, 10)
        )
    )
    recipe = load_recipe(
        _with_data(_recipe(work, checkpoint_every=1, steps=2, warmup_steps=1), data)
    )
    run_dir = work / "run"
    run(recipe, run_dir)
    first, newest = checkpoints.complete(run_dir)
    assert (first.name, newest.name) == ("step_00001", "step_00002")
    logged = {p: p.read_text() for p in _logs(run_dir)}
    assert len(logged) == 4  # metrics, spans, the rollouts of steps 0 and 1
    shards = [next((c / "learner" / "sharded").glob("*.distcp")) for c in (first, newest)]
    whole = [f.read_bytes() for f in shards]
    shards[0].write_bytes(whole[0][: len(whole[0]) // 2])

    procs = []
    start_service = role_handles.start_local_service

    def start_and_note(*args, **kwargs):
        procs.append(start_service(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(role_handles, "start_local_service", start_and_note)
    with pytest.raises(Exception):  # noqa: B017  (the learner's own loading error)
        run(recipe, run_dir, resume=first)  # the Python API does not verify first
    monkeypatch.undo()
    assert len(procs) == 1 and procs[0].poll() is not None  # the reward service stopped
    assert {p: p.read_text() for p in _logs(run_dir)} == logged  # step 1's lines kept

    monkeypatch.setattr(loop, "run", lambda *a, **k: pytest.fail("a role started"))
    cli, more = CliRunner(), ["--set", "train.steps=3"]
    shards[1].write_bytes(whole[1][:-1])
    out = cli.invoke(app, ["run", "--resume", str(run_dir), *more])
    assert out.exit_code == 2 and str(shards[1]) in out.output, out.output
    assert "no earlier checkpoint is whole" in out.output  # step_00001's shard is cut too
    shards[0].write_bytes(whole[0])
    out = cli.invoke(app, ["run", "--resume", str(run_dir), *more])
    assert out.exit_code == 2 and "step_00001 is whole" in out.output, out.output

    shards[1].write_bytes(whole[1])
    text = data.read_text()
    data.write_text(text.replace("What is 3 + 3?", "What is 3 + 4?"))
    assert len(data.read_text()) == len(text)
    out = cli.invoke(app, ["run", "--resume", str(run_dir), *more])
    assert out.exit_code == 2 and f"data.train.path {data}" in out.output, out.output
    assert "--accept-data-change" in out.output


def _with_data(recipe_file, data):
    import yaml

    body = yaml.safe_load(recipe_file.read_text())
    body["data"] = {"train": {"path": str(data)}}
    recipe_file.write_text(yaml.safe_dump(body))
    return recipe_file


def _logs(run_dir):
    return sorted([run_dir / "metrics.jsonl", run_dir / "spans.jsonl"]) + sorted(
        (run_dir / "rollouts").glob("*.jsonl")
    )
