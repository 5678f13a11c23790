"""Fault drills with real process kills and real signals on a tiny model (HF engines):
a learner rank killed in `train_step` (the run stops naming its checkpoint, or restarts
its learner group by itself), a rollout worker killed under the collective (gloo
broadcast) transport, and Ctrl-C (SIGINT to this process) during `generate`,
`train_step` and `push_weights`, each followed by a resume to the end.

Each drill learns that its phase has begun from a wrapper around the controller's call
of that phase (the call itself runs unchanged); a `debug.*_delay_s` keeps the phase
busy for seconds, so the kill or signal lands inside it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from posttrain.recipes import checkpoints, controller
from posttrain.recipes.algo import base as algorithm
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import RunStopped, run
from posttrain.recipes.recovery import LearnerDied
from posttrain.recipes.roles import start as role_start
from tests.test_faults_e2e import _recipe as _fault_recipe

KEYS = ("loss", "reward_mean", "lr", "grad_norm", "policy_version")


def _recipe(tmp_path: Path, model_path: Path, name: str, **blocks) -> Path:
    """3 GRPO steps, 4 prompts a step on 1 engine, 2 learner ranks, a checkpoint every
    step (`blocks` replace whole top-level blocks)."""
    f = _fault_recipe(
        tmp_path,
        model_path,
        **{
            "train": {
                "steps": 3,
                "prompts_per_step": 4,
                "micro_batch_size": 2,
                "lr": 1e-2,
                "checkpoint_every": 1,
                "keep_checkpoints": 3,
            },
            "resources": {"rollout": {"gpus": 1}, "learner": {"gpus": 2}, "threads_per_worker": 1},
            **blocks,
        },
    )
    named = tmp_path / f"{name}.yaml"
    f.rename(named)
    return named


def _at_phase(
    monkeypatch,
    module,
    name: str,
    when: Callable[..., bool],
    act: Callable[..., Callable[[], None]],
) -> list[int]:
    """Wrap `module.name` so that on the first call where `when(*args, **kwargs)` holds,
    `act(*args)` returns a function that a thread runs 1 s later, while the real call
    runs; returns a list that gets one item when it fired."""
    real, fired = getattr(module, name), []

    def wrapper(*args, **kwargs):
        if not fired and when(*args, **kwargs):
            fired.append(1)
            threading.Timer(1.0, act(*args)).start()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return fired


def _kill_learner_in_train_step(monkeypatch, step: int, rank: int) -> list[int]:
    """`kill -9` of learner rank `rank`'s process 1 s into step `step`'s train_step."""

    def kill(learners, *args) -> Callable[[], None]:  # the ranks are idle until the call
        pid = ray.get(learners[rank].__ray_call__.remote(lambda self: os.getpid()))
        return lambda: os.kill(pid, signal.SIGKILL)

    # run_updates sends each update as on_learners(learners, "train_step", batch, step)
    return _at_phase(
        monkeypatch,
        algorithm,
        "on_learners",
        lambda learners, method, batch, *a, **k: method == "train_step" and a[0] == step,
        kill,
    )


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").open()]


def _final(run_dir: Path):
    return load_file(run_dir / "final" / "model.safetensors")


# learner_delay_s: train_step sleeps 2 s after the backward; the kill lands there
DEBUG = {"debug": {"learner_delay_s": 2.0}}


def _restarting_run(tiny_model, tmp_path, monkeypatch, run_dir: Path) -> list[dict]:
    """max_restarts 1, collective push, learner rank 1 killed in step 1's train_step:
    the group restarts from step 1's checkpoint by itself (a new broadcast group with
    the new rank 0) and steps 1-2 run again."""
    fired = _kill_learner_in_train_step(monkeypatch, step=1, rank=1)
    train = {
        "steps": 3,
        "prompts_per_step": 4,
        "micro_batch_size": 2,
        "lr": 1e-2,
        "checkpoint_every": 1,
        "keep_checkpoints": 3,
        "max_restarts": 1,
    }
    history = run(
        load_recipe(
            _recipe(
                tmp_path, tiny_model, "b", train=train, weight_sync={"type": "collective"}, **DEBUG
            )
        ),
        run_dir,
    )
    monkeypatch.undo()
    assert fired
    return history


def test_learner_killed_restarts_the_learner_group(tiny_model, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    history = _restarting_run(tiny_model, tmp_path, monkeypatch, run_dir)
    assert [m["step"] for m in history] == [0, 1, 2] and _steps(run_dir) == [0, 1, 2]
    assert [m["learner_restarts"] for m in history] == [0, 1, 1]
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    for step in range(3):  # step 1's samples were made again with policy_version 1
        saved = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open()]
        assert len(saved) == 8 and all(r["policy_version"] == step for r in saved)
    assert (run_dir / "final" / "model.safetensors").is_file()


@pytest.mark.slow  # 3 runs, about 115 s
def test_learner_killed_stops_and_a_resume_equals_the_restart(tiny_model, tmp_path, monkeypatch):
    # max_restarts 0 (default): the run stops naming step 1's checkpoint; a resume ends it
    stopped = tmp_path / "stopped"
    fired = _kill_learner_in_train_step(monkeypatch, step=1, rank=1)
    recipe = load_recipe(_recipe(tmp_path, tiny_model, "a", **DEBUG))
    with pytest.raises(LearnerDied) as died:
        run(recipe, stopped)
    assert fired
    message = str(died.value)
    assert "learner rank 1 died in step 1" in message
    assert f"Last good checkpoint: {stopped / 'checkpoints' / 'step_00001'}" in message
    assert f"posttrain run --resume {stopped}" in message
    monkeypatch.undo()
    rest = run(recipe, stopped, resume=checkpoints.latest(stopped))
    assert [m["step"] for m in rest] == [1, 2] and _steps(stopped) == [0, 1, 2]

    # both went through step 1's checkpoint: the same numbers and weights, bit for bit
    restarted = tmp_path / "restarted"
    history = _restarting_run(tiny_model, tmp_path, monkeypatch, restarted)
    want = [json.loads(x) for x in (stopped / "metrics.jsonl").open()]
    for key in KEYS:
        assert [m[key] for m in history] == [m[key] for m in want], key
    a, b = _final(stopped), _final(restarted)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_learner_killed_under_staleness_restarts_and_trains_each_prompt_once(
    tiny_model, tmp_path, monkeypatch
):
    """train.max_staleness 1, max_restarts 1, learner rank 1 killed in step 1's
    train_step: the producer stops, the group restarts from step 1's checkpoint, and a
    new producer starts from its pending prompts: over the run's records each of the
    first 12 prompts of the data order trained exactly once, step 1 under policy 1."""
    from posttrain.recipes.data import prompt_stream
    from tests.test_async_e2e import _trained_prompt_ids

    fired = _kill_learner_in_train_step(monkeypatch, step=1, rank=1)
    recipe_file = _recipe(
        tmp_path,
        tiny_model,
        "a",
        train={
            "steps": 3,
            "prompts_per_step": 4,
            "micro_batch_size": 2,
            "lr": 1e-2,
            "checkpoint_every": 1,
            "max_restarts": 1,
            "max_staleness": 1,
        },
        **DEBUG,
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)
    monkeypatch.undo()

    assert fired and [m["learner_restarts"] for m in history] == [0, 1, 1]
    assert [m["policy_version"] for m in history] == [1, 2, 3] and _steps(run_dir) == [0, 1, 2]
    order = prompt_stream(list(range(20)), 4, seed=load_recipe(recipe_file).data.shuffle_seed)
    assert sorted(_trained_prompt_ids(run_dir, 3)) == sorted(
        p for _ in range(3) for p in next(order)
    )
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00001.jsonl").open()]
    assert all(r["policy_version"] == 1 for r in saved)  # made again after the restart


@pytest.mark.slow  # 2 runs, about 70 s
def test_learner_killed_before_any_checkpoint_restarts_from_step_0(
    tiny_model, tmp_path, monkeypatch
):
    train = {"steps": 2, "prompts_per_step": 4, "micro_batch_size": 2, "lr": 1e-2}
    straight = run(
        load_recipe(_recipe(tmp_path, tiny_model, "s", train=train)), tmp_path / "straight"
    )
    fired = _kill_learner_in_train_step(monkeypatch, step=0, rank=0)
    history = run(
        load_recipe(
            _recipe(
                tmp_path,
                tiny_model,
                "k",
                train={**train, "max_restarts": 1},
                debug={"learner_delay_s": 2.0},
            )
        ),
        tmp_path / "killed",
    )
    assert fired and [m["learner_restarts"] for m in history] == [1, 1]
    for key in KEYS:
        assert [m[key] for m in history] == [m[key] for m in straight], key


def test_rollout_worker_killed_with_collective_push(tiny_model, tmp_path, monkeypatch):
    workers: list = []
    start = role_start.start_rollout

    def start_and_keep(spec, placement):
        workers.extend(start(spec, placement))
        return list(workers)

    monkeypatch.setattr(role_start, "start_rollout", start_and_keep)
    run_dir = tmp_path / "run"

    def kill_in_step_1() -> None:
        # each engine joins the push group while constructed, with the learner: ask its
        # pid from here, not from start_rollout (that would wait for the learner)
        while not workers:
            time.sleep(0.1)
        pid = ray.get(workers[1].health.remote())["pid"]
        ready = run_dir / "metrics.jsonl"  # step 0 logged: step 1's generate is under way
        while not (ready.exists() and ready.read_text().strip()):
            time.sleep(0.1)
        time.sleep(1.0)  # generate sleeps 3 s after sampling: 1 s into it
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_in_step_1, daemon=True)
    killer.start()
    recipe = _fault_recipe(
        tmp_path,
        tiny_model,
        debug={"rollout_delay_s": 3.0},
        weight_sync={"type": "collective"},
        train={"steps": 3, "prompts_per_step": 4, "micro_batch_size": 2, "lr": 1e-3},
    )
    history = run(load_recipe(recipe), run_dir)
    killer.join(timeout=5)

    assert [m["rollout_restarts"] for m in history] == [0, 1, 1]
    assert [m["policy_version"] for m in history] == [1, 2, 3]  # step 2 pushed to the new group
    for step in (1, 2):
        saved = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open()]
        assert len(saved) == 8 and len({r["group_id"] for r in saved}) == 4
        assert all(r["policy_version"] == step for r in saved)


def test_sigterm_during_start_up_stops_every_role_and_says_so(tiny_model, tmp_path, monkeypatch):
    """A SIGTERM while the roles start (`timeout`, a batch scheduler's time limit): before,
    Ray's handler in the driver printed a native stack trace and raised SystemExit(15)
    with no word of what was saved; now start-up ends, every role stops and the run
    says nothing was trained or saved."""
    real = controller.start_roles

    def start_then_sigterm(*args, **kwargs):
        roles = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return roles

    monkeypatch.setattr(controller, "start_roles", start_then_sigterm)
    run_dir = tmp_path / "run"
    recipe = load_recipe(_recipe(tmp_path, tiny_model, "sigterm"))
    with pytest.raises(RunStopped, match="during start-up: nothing was trained") as stop:
        run(recipe, run_dir)
    assert stop.value.signum == signal.SIGTERM and stop.value.steps_done == 0
    assert checkpoints.latest(run_dir) is None and not ray.is_initialized()
    assert not (run_dir / "metrics.jsonl").exists() or _steps(run_dir) == []


# A real SIGINT to this process at the phase: (module, function, when, debug delay)
PHASES = {
    "generate": (
        controller,
        "generate",
        lambda roles_, prompts, recipe, step, *a, **k: step == 1,
        {"rollout_delay_s": 3.0},
    ),
    "train_step": (
        algorithm,
        "on_learners",
        lambda learners, method, batch, *a, **k: method == "train_step" and a[0] == 1,
        {"learner_delay_s": 3.0},
    ),
    "push_weights": (
        controller,
        "push_weights",
        lambda roles_, recipe, version: version == 2,
        {"push_delay_s": 3.0},
    ),
}


@pytest.mark.parametrize(
    "phase",
    [
        "train_step",
        pytest.param("generate", marks=pytest.mark.slow),  # each about 45 s
        pytest.param("push_weights", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_in_a_phase_leaves_a_resumable_run(phase, tiny_model, tmp_path, monkeypatch):
    module, name, when, delay = PHASES[phase]
    fired = _at_phase(
        monkeypatch, module, name, when, lambda *args: lambda: os.kill(os.getpid(), signal.SIGINT)
    )
    run_dir = tmp_path / "run"
    recipe = load_recipe(
        _recipe(
            tmp_path,
            tiny_model,
            phase,
            debug=delay,
            train={"steps": 4, "prompts_per_step": 4, "micro_batch_size": 2, "lr": 1e-2},
        )
    )
    with pytest.raises(RunStopped, match=f"posttrain run --resume {run_dir}") as stop:
        run(recipe, run_dir)
    assert fired and stop.value.signum == signal.SIGINT
    # step 1 finished (its push included), then the checkpoint, then the stop
    assert _steps(run_dir) == [0, 1]
    ckpt = checkpoints.latest(run_dir)
    assert ckpt.name == "step_00002" and checkpoints.read_state(ckpt)["policy_version"] == 2
    monkeypatch.undo()
    rest = run(recipe, run_dir, resume=ckpt)
    assert [m["step"] for m in rest] == [2, 3] and _steps(run_dir) == [0, 1, 2, 3]
    assert [m["policy_version"] for m in rest] == [3, 4]
    for step in range(4):
        saved = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open()]
        assert len(saved) == 8 and all(r["policy_version"] == step for r in saved)
