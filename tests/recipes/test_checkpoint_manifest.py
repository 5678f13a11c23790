"""A damaged checkpoint is found before anything starts: every checkpoint carries a
manifest of its files' sizes and sha256 (written inside the folder before its atomic
rename), and `posttrain run --resume` checks it first. A truncated shard, optimizer /
scheduler / RNG file or controller RNG file, a flipped byte or a missing file exits 2
naming the file, and offers the previous whole checkpoint; no role is started.
Checkpoints here are written by `checkpoints.save` with stand-in learners (no Ray)."""

from __future__ import annotations

import json
import os

import pytest
import ray
from typer.testing import CliRunner

from posttrain.recipes import checkpoints, loop
from posttrain.recipes.cli import app
from posttrain.recipes.loading import load_recipe
from tests.test_grpo_e2e import _grpo_recipe


class _Save:
    def remote(self, path, steps_done, kind):
        """What a learner rank writes: DCP shards with their metadata, and its
        scheduler / step count / RNG file."""
        shards = os.path.join(path, "sharded")
        os.makedirs(shards, exist_ok=True)
        with open(os.path.join(shards, "__0_0.distcp"), "wb") as f:
            f.write(bytes(range(256)) * 16 * (steps_done + 1))
        with open(os.path.join(shards, ".metadata"), "wb") as f:
            f.write(b"dcp-metadata" * 10)
        with open(os.path.join(path, "rank_0.pt"), "wb") as f:
            f.write(b"scheduler, optimizer_steps, rngs" * 20)
        return steps_done


class FakeLearner:
    save_checkpoint = _Save()


@pytest.fixture
def run_dir(tmp_path, tiny_model, monkeypatch):
    """A run with complete checkpoints after 2 and 4 of its 6 steps."""
    monkeypatch.setattr(ray, "get", lambda refs, **kw: refs)
    recipe = load_recipe(_grpo_recipe(tmp_path, tiny_model, train=_TRAIN))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text((tmp_path / "tiny.yaml").read_text())
    for done in (2, 4):
        checkpoints.save(run_dir, recipe, [FakeLearner()], done, None, {})
    monkeypatch.undo()
    return run_dir


_TRAIN = {"steps": 6, "prompts_per_step": 3, "micro_batch_size": 2, "lr": 1e-3}


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip(file):
    data = bytearray(file.read_bytes())
    data[100] ^= 0x01
    file.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": ("learner/sharded/__0_0.distcp", _truncate),
    "truncated optimizer/RNG state": ("learner/rank_0.pt", _truncate),
    "truncated controller RNG": ("controller_rng.pt", _truncate),
    "flipped byte": ("learner/sharded/__0_0.distcp", _flip),
    "missing file": ("learner/sharded/.metadata", lambda f: f.unlink()),
}


def test_a_whole_checkpoint_verifies(run_dir):
    for ckpt in checkpoints.complete(run_dir):
        assert checkpoints.verify(ckpt) is True
    files = json.loads((checkpoints.latest(run_dir) / checkpoints.MANIFEST).read_text())["files"]
    assert sorted(files) == [
        "controller_rng.pt",
        "learner/rank_0.pt",
        "learner/sharded/.metadata",
        "learner/sharded/__0_0.distcp",
        "recipe.yaml",
        "trainer_state.json",
    ]
    assert files["learner/sharded/__0_0.distcp"]["bytes"] == 4096 * 5


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_of_a_damaged_checkpoint_exits_2_naming_the_file(damage, run_dir, monkeypatch):
    name, spoil = DAMAGE[damage]
    newest = checkpoints.latest(run_dir)
    spoil(newest / name)

    def started(*args, **kwargs):
        raise AssertionError("the run started from a damaged checkpoint")

    monkeypatch.setattr(loop, "run", started)
    out = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert out.exit_code == 2, out.output
    assert str(newest / name) in out.output  # the damaged file, by its full path
    assert "step_00002 is whole" in out.output  # the previous checkpoint, offered
    assert f"mv {newest} {newest.parent / 'damaged-step_00004'}" in out.output
    assert f"posttrain run --resume {run_dir}" in out.output
    with pytest.raises(checkpoints.CheckpointDamaged, match=name):
        checkpoints.verify(newest)


def test_no_whole_checkpoint_left_says_start_over(run_dir, monkeypatch):
    for ckpt in checkpoints.complete(run_dir):
        _truncate(ckpt / "learner" / "rank_0.pt")
    monkeypatch.setattr(loop, "run", lambda *a, **k: pytest.fail("started"))
    out = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert out.exit_code == 2 and "no earlier checkpoint is whole" in out.output
    assert f"posttrain run {run_dir / 'recipe.yaml'} --out NEW_DIR" in out.output


def test_learner_restart_skips_a_damaged_checkpoint(run_dir):
    """recipes/recovery.py restarts a learner group from the newest whole checkpoint."""
    from posttrain.recipes.recovery import last_good

    _truncate(checkpoints.latest(run_dir) / "learner" / "sharded" / "__0_0.distcp")
    assert last_good(run_dir, 10).name == "step_00002"


def test_a_checkpoint_from_before_manifests_still_resumes(run_dir):
    (checkpoints.latest(run_dir) / checkpoints.MANIFEST).unlink()
    assert checkpoints.verify(checkpoints.latest(run_dir)) is False  # not checked, not refused
