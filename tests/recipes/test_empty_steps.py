"""No optimizer step without data: a step whose batch holds no response token (every
score failed, every group dropped) never calls the learners, a mini-batch left without
one is skipped, every such step is reported, and `train.max_empty_steps` of them in a
row stop the run after a checkpoint, naming the cause. Stand-in learners (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.actors.rollout import Rollout
from posttrain.config import RecipeError
from posttrain.recipes import checkpoints, empty_steps
from posttrain.recipes.algo import base
from posttrain.recipes.algo.rollouts import apply_failure_policy, rollout_batch
from posttrain.recipes.empty_steps import EmptySteps, NothingToTrain, train_or_skip
from posttrain.recipes.loading import load_recipe
from posttrain.rewards.protocol import Score
from tests.test_grpo_e2e import _grpo_recipe

DOWN = "request failed: ConnectError: [Errno 111] Connection refused"


def _rollouts(n: int = 4) -> list[Rollout]:
    return [
        Rollout(f"s0-p{i // 2}-0-{i % 2}", f"s0-p{i // 2}-0", [5, 6], [7, 8, 9], [-1.0] * 3,
                "stop", 0, "q", "r")
        for i in range(n)
    ]  # fmt: skip


class NeverTrain:
    recipe = SimpleNamespace(on_reward_failure="drop_group")

    def train(self, *args):
        raise AssertionError("the learners were called with nothing to train on")


def test_a_step_with_nothing_scored_does_not_train():
    rollouts = _rollouts()
    scores = [Score(uid=r.uid, reward=None, error=DOWN) for r in rollouts]
    rewards = apply_failure_policy(scores, rollouts, "drop_group")
    batch = rollout_batch(rollouts, rewards, pad_id=0)
    stats = train_or_skip(NeverTrain(), [], batch, rollouts, rewards, scores, 3)
    assert stats == {
        "empty_step": 1.0,
        "empty_step_cause": f"none of the 4 samples could be scored (first error: {DOWN})",
        "time/logprobs": 0.0,
        "time/train": 0.0,
    }


def test_every_group_dropped_names_the_failure_policy():
    rollouts = _rollouts()
    # one sample of each group failed: drop_group leaves out both groups
    scores = [
        Score(uid=r.uid, reward=None if i % 2 else 1.0, error=DOWN if i % 2 else None)
        for i, r in enumerate(rollouts)
    ]
    rewards = apply_failure_policy(scores, rollouts, "drop_group")
    stats = train_or_skip(
        NeverTrain(), [], rollout_batch(rollouts, rewards, 0), rollouts, rewards, scores, 0
    )
    assert stats["empty_step_cause"] == (
        "on_reward_failure: drop_group left out every group (2 of 4 samples could not be "
        f"scored; first error: {DOWN})"
    )


def test_a_step_with_data_trains_and_says_so():
    rollouts = _rollouts()
    rewards = [1.0, 0.0, 1.0, 0.0]
    scores = [Score(uid=r.uid, reward=x) for r, x in zip(rollouts, rewards, strict=True)]
    algo = SimpleNamespace(train=lambda *a: {"loss": 0.25, "updates": 1.0})
    batch = rollout_batch(rollouts, rewards, 0)
    stats = train_or_skip(algo, [], batch, rollouts, rewards, scores, 0)
    assert stats == {"loss": 0.25, "updates": 1.0, "empty_step": 0.0}


def test_run_updates_skips_a_mini_batch_without_tokens(monkeypatch):
    calls = []

    def on_learners(learners, method, batch, step):
        calls.append(batch.input_ids[:, 0].tolist())
        return [{"loss": 1.0, "grad_norm": 0.5, "lr": 1e-3}]

    monkeypatch.setattr(base, "on_learners", on_learners)
    rollouts = _rollouts()
    # the seeded order run_updates draws for 2 mini-batches: mask the first one's rows
    order = torch.randperm(4, generator=torch.Generator().manual_seed(11))
    first = set(order[:2].tolist())
    rewards = [None if i in first else 1.0 for i in range(4)]
    batch = rollout_batch(rollouts, rewards, 0)
    batch.input_ids[:, 0] = torch.arange(4)  # tag each row
    batch.advantages = torch.zeros_like(batch.response_mask)
    stats = base.run_updates([None], batch, 4, 1, 2, "token_mean", 11, 0)
    assert calls == [order[2:].tolist()]  # the second mini-batch only
    assert stats == {"loss": 1.0, "grad_norm": 0.5, "lr": 1e-3, "updates": 1.0}

    calls.clear()
    batch.response_mask[:] = 0  # every row masked (e.g. grpo.mask_truncated)
    assert base.run_updates([None], batch, 4, 2, 2, "token_mean", 11, 0) == {"updates": 0.0}
    assert calls == []


def test_trained_nothing_after_masking_is_an_empty_step():
    rollouts = _rollouts()
    rewards = [1.0, 0.0, 1.0, 0.0]
    scores = [Score(uid=r.uid, reward=x) for r, x in zip(rollouts, rewards, strict=True)]
    algo = SimpleNamespace(train=lambda *a: {"updates": 0.0, "time/train": 0.0})
    batch = rollout_batch(rollouts, rewards, 0)
    stats = train_or_skip(algo, [], batch, rollouts, rewards, scores, 0)
    assert stats["empty_step"] == 1.0 and "mask_truncated" in stats["empty_step_cause"]


def _run(tmp_path, saved):
    def save_run(run, algo, done):
        folder = tmp_path / "checkpoints" / f"step_{done:05d}"
        folder.mkdir(parents=True)
        (folder / checkpoints.STATE_FILE).write_text("{}")
        saved.append(done)
        return folder

    return SimpleNamespace(run_dir=tmp_path), save_run


def test_max_empty_steps_in_a_row_stop_after_a_checkpoint(tmp_path, monkeypatch, capsys):
    saved: list[int] = []
    run, save_run = _run(tmp_path, saved)
    monkeypatch.setattr(empty_steps.checkpoints, "save_run", save_run)
    guard = EmptySteps(limit=2)
    cause = f"none of the 4 samples could be scored (first error: {DOWN})"
    empty = {"empty_step": 1.0, "empty_step_cause": cause}
    guard.after_step(run, None, 0, empty)
    guard.after_step(run, None, 1, {"empty_step": 0.0})  # trained: the count starts again
    guard.after_step(run, None, 2, empty)
    with pytest.raises(NothingToTrain) as stop:
        guard.after_step(run, None, 3, empty)
    assert saved == [4]  # a checkpoint after the 4 steps done
    assert str(stop.value) == (
        "steps 2-3: 2 steps in a row had nothing to train on (train.max_empty_steps: 2); "
        f"the last: {cause}. No optimizer step was taken in them. Checkpoint "
        f"{tmp_path / 'checkpoints' / 'step_00004'}; once the cause is fixed (e.g. the "
        f"reward service answers again), resume with: posttrain run --resume {tmp_path}"
    )
    console = capsys.readouterr().out
    assert console.count("nothing to train on, no optimizer step") == 3
    assert "2 such step(s) in a row" in console


def test_a_checkpoint_already_written_is_not_written_again(tmp_path, monkeypatch):
    saved: list[int] = []
    run, save_run = _run(tmp_path, saved)
    save_run(run, None, 1)  # the due checkpoint the loop wrote after step 0
    monkeypatch.setattr(empty_steps.checkpoints, "save_run", save_run)
    with pytest.raises(NothingToTrain, match="step_00001"):
        EmptySteps(limit=1).after_step(run, None, 0, {"empty_step": 1.0})
    assert saved == [1]


def test_no_limit_never_stops(tmp_path):
    guard = EmptySteps(limit=None)
    for step in range(50):
        guard.after_step(SimpleNamespace(run_dir=tmp_path), None, step, {"empty_step": 1.0})


def test_schema_default_and_bounds(tmp_path, tiny_model):
    recipe = load_recipe(_grpo_recipe(tmp_path, tiny_model))
    assert recipe.train.max_empty_steps == 3
    with pytest.raises(RecipeError, match="max_empty_steps"):
        load_recipe(tmp_path / "tiny.yaml", ["train.max_empty_steps=0"])
    unlimited = load_recipe(tmp_path / "tiny.yaml", ["train.max_empty_steps=null"])
    assert unlimited.train.max_empty_steps is None
    changed = recipe.model_copy(
        update={"train": recipe.train.model_copy(update={"max_empty_steps": 10})}
    )
    assert checkpoints.resume_changes(recipe, changed) == ["train.max_empty_steps: 3 → 10"]
