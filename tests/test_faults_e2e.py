"""Fault drills with real process kills on a tiny model (HF engines, object-store push):
what a run survives, and that it survives it without losing or repeating a sample."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import ray
import yaml

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from posttrain.recipes.monitoring.log import read_jsonl
from posttrain.recipes.roles import handles as role_handles
from posttrain.recipes.roles import start as role_start


def _recipe(tmp_path: Path, model_path: Path, **blocks) -> Path:
    """A 2-step GRPO recipe with 2 rollout engines, 4 prompts a step (2 per engine)."""
    recipe = {
        "name": "tiny-faults",
        "algorithm": "grpo",
        "model": {"path": str(model_path), "dtype": "float32"},
        "data": {"train": {"generator": "arithmetic", "size": 20, "seed": 1}},
        "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
        "rewards": [{"name": "short", "type": "length", "target_chars": 3}],
        "train": {"steps": 2, "prompts_per_step": 4, "micro_batch_size": 2, "lr": 1e-3},
        "resources": {"rollout": {"gpus": 2}, "learner": {"gpus": 1}, "threads_per_worker": 1},
        "weight_sync": {"type": "object_store"},
        "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
        **blocks,
    }
    f = tmp_path / "faults.yaml"
    f.write_text(yaml.safe_dump(recipe))
    return f


def _kill_when(pids: list[int], index: int, ready: Path, delay_s: float) -> threading.Thread:
    """A thread that `kill -9`s `pids[index]` `delay_s` seconds after `ready` exists and
    has a line (the first step logged: the next generate is under way)."""

    def kill() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and not (ready.exists() and ready.read_text().strip()):
            time.sleep(0.1)
        time.sleep(delay_s)
        os.kill(pids[index], signal.SIGKILL)

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


def test_rollout_worker_killed_mid_generate(tiny_model, tmp_path, monkeypatch):
    pids: list[int] = []
    start = role_start.start_rollout

    def start_and_note_pids(spec, placement):
        workers = start(spec, placement)
        pids.extend(h["pid"] for h in ray.get([w.health.remote() for w in workers]))
        return workers

    monkeypatch.setattr(role_start, "start_rollout", start_and_note_pids)
    run_dir = tmp_path / "run"
    # generate sleeps 3 s after sampling: worker 1 dies 1 s into step 1's generate
    killer = _kill_when(pids, 1, run_dir / "metrics.jsonl", delay_s=1.0)
    history = run(
        load_recipe(_recipe(tmp_path, tiny_model, debug={"rollout_delay_s": 3.0})), run_dir
    )
    killer.join(timeout=5)

    assert [m["rollout_restarts"] for m in history] == [0, 1]
    assert [m["policy_version"] for m in history] == [1, 2]
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00001.jsonl").open()]
    groups = [r["group_id"] for r in saved]
    assert len(groups) == 8 and len(set(groups)) == 4  # 4 groups of 2, none twice
    assert sorted(r["uid"] for r in saved) == sorted({r["uid"] for r in saved})
    assert all(r["policy_version"] == 1 for r in saved)  # the replacement got version 1
    assert all(r["reward"] is not None for r in saved)


def test_failed_weight_push_is_retried_then_stops_with_a_checkpoint(tiny_model, tmp_path):
    import pytest

    from posttrain.recipes import checkpoints
    from posttrain.recipes.loop import PushFailed

    run_dir = tmp_path / "run"
    # engine 1 refuses policy_version 2 (step 1's push) on both tries
    bad = load_recipe(
        _recipe(
            tmp_path,
            tiny_model,
            debug={"fail_weight_push": [1, 2]},
            train={"steps": 3, "prompts_per_step": 4, "micro_batch_size": 2, "lr": 1e-3},
        )
    )
    with pytest.raises(PushFailed) as stop:
        run(bad, run_dir)
    message = str(stop.value)
    assert "rollout worker 1" in message and "policy_version 2" in message
    assert "still serve policy_versions [2, 1]" in message  # engine 1 kept version 1
    assert "posttrain run --resume" in message
    ckpt = checkpoints.latest(run_dir)
    assert ckpt is not None and checkpoints.read_state(ckpt)["policy_version"] == 2
    # step 1 trained (the checkpoint holds it), so its line is written: it was lost, and
    # the metrics read steps [0, 2] after the resume
    logged = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in logged] == [0, 1] and logged[1]["weight_push_failed"] == 1
    assert logged[1]["policy_version"] == 2 and "loss" in logged[1]

    good = bad.model_copy(update={"debug": bad.debug.model_copy(update={"fail_weight_push": None})})
    history = run(good, run_dir, resume=ckpt)  # the resume pushes version 2 to both
    assert [m["step"] for m in history] == [2] and history[0]["policy_version"] == 3
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00002.jsonl").open()]
    assert len(saved) == 8 and all(r["policy_version"] == 2 for r in saved)


def test_reward_service_killed_mid_request(tiny_model, tmp_path, monkeypatch):
    procs = []
    start = role_handles.start_local_service

    def start_and_note(*args, **kwargs):
        procs.append(start(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(role_handles, "start_local_service", start_and_note)
    mark = tmp_path / "scoring_began"
    monkeypatch.setenv("POSTTRAIN_TEST_SCORING_MARK", str(mark))

    def kill_when_scoring() -> None:  # 8 items at 0.5 s on 2 workers: ~2 s to hit
        deadline = time.time() + 300
        while time.time() < deadline and not mark.exists():
            time.sleep(0.05)
        os.kill(procs[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_scoring, daemon=True)
    killer.start()
    recipe = _recipe(
        tmp_path,
        tiny_model,
        rewards=[
            {"name": "slow", "type": "python", "function": "tests.rewards.user_rewards:slow_length"}
        ],
        train={"steps": 1, "prompts_per_step": 4, "micro_batch_size": 2, "lr": 1e-3},
        resources={"rollout": {"gpus": 1}, "learner": {"gpus": 1}, "threads_per_worker": 1},
    )
    history = run(load_recipe(recipe), tmp_path / "run")
    killer.join(timeout=5)

    assert len(procs) == 2 and procs[0].returncode == -signal.SIGKILL
    assert history[0]["reward_restarts"] == 1 and history[0]["failed_scores"] == 0
    saved = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_00000.jsonl").open()]
    assert len(saved) == 8 and len({r["uid"] for r in saved}) == 8
    # each sample scored once by the restarted service: its own length, neither 0 nor 2x
    assert [r["reward"] for r in saved] == [float(len(r["response_text"])) for r in saved]
    assert any(r["reward"] > 0 for r in saved)


def test_engine_killed_in_an_async_push_stops_with_a_checkpoint(tiny_model, tmp_path, monkeypatch):
    """train.max_staleness 1: engine 1 is killed 1 s into step 1's push (update_weights
    sleeps 3 s): the run ends as the synchronous path does, PushFailed naming the
    engine, with a checkpoint after step 1 and the resume command (it was a raw
    ActorDiedError traceback)."""
    import pytest

    from posttrain.recipes import checkpoints, controller
    from posttrain.recipes.loop import PushFailed

    real, fired = controller.push_weights, []

    def push_and_kill(roles_, recipe, version):
        if version == 2 and not fired:  # step 1's push; the producer is paused: 1 answers
            fired.append(ray.get(roles_.rollout[1].health.remote())["pid"])
            threading.Timer(1.0, os.kill, (fired[0], signal.SIGKILL)).start()
        return real(roles_, recipe, version)

    monkeypatch.setattr(controller, "push_weights", push_and_kill)
    run_dir = tmp_path / "run"
    recipe = _recipe(
        tmp_path,
        tiny_model,
        debug={"push_delay_s": 3.0},
        train={
            "steps": 3,
            "prompts_per_step": 4,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "max_staleness": 1,
        },
    )
    with pytest.raises(PushFailed) as stop:
        run(load_recipe(recipe), run_dir)
    assert fired
    message = str(stop.value)
    assert "step 1:" in message and "rollout engine 1 died during the push" in message
    assert "policy_version 2" in message and f"posttrain run --resume {run_dir}" in message
    ckpt = checkpoints.latest(run_dir)
    assert ckpt.name == "step_00002" and checkpoints.read_state(ckpt)["policy_version"] == 2
    assert checkpoints.verify(ckpt)
    logged = read_jsonl(run_dir / "metrics.jsonl")  # step 1 trained: its line is kept
    assert [m["step"] for m in logged] == [0, 1] and logged[1]["weight_push_failed"] == 1


def test_reward_service_down_trains_nothing_and_stops(tiny_model, tmp_path):
    """Every score fails (nothing listens at the reward URL): no optimizer step is
    taken, each step reports empty_step, and train.max_empty_steps (2) such steps in a
    row stop the run with a checkpoint and exit 1 naming the cause (it trained every
    step on nothing, AdamW moving every weight, and exited 0)."""
    import torch
    from typer.testing import CliRunner

    from posttrain.common.net import free_port
    from posttrain.recipes import checkpoints
    from posttrain.recipes.cli import app

    down = f"http://127.0.0.1:{free_port()}/score"  # a free port: every request refused
    recipe = _recipe(
        tmp_path,
        tiny_model,
        rewards=[{"name": "remote", "type": "http", "url": down, "retries": 0}],
        train={
            "steps": 4,
            "prompts_per_step": 4,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "max_empty_steps": 2,
        },
        resources={"rollout": {"gpus": 1}, "learner": {"gpus": 1}, "threads_per_worker": 1},
    )
    run_dir = tmp_path / "run"
    out = CliRunner().invoke(app, ["run", str(recipe), "--out", str(run_dir)])
    assert out.exit_code == 1, out.output
    assert "steps 0-1: 2 steps in a row had nothing to train on" in out.output
    assert "none of the 8 samples could be scored (first error: remote: request failed" in (
        out.output
    )
    assert f"posttrain run --resume {run_dir}" in out.output
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    assert [(r["step"], r["empty_step"], r["failed_scores"]) for r in rows] == [
        (0, 1.0, 8.0),
        (1, 1.0, 8.0),
    ]
    ckpt = checkpoints.latest(run_dir)
    assert ckpt.name == "step_00002" and checkpoints.verify(ckpt)
    learner = torch.load(ckpt / "learner" / "rank_0.pt", weights_only=False)
    assert learner["optimizer_steps"] == 0  # no weight moved
    assert not (run_dir / "final").exists()
