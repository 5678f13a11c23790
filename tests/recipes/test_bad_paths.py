"""Paths that ended in a traceback or a hang end in one line naming the path and the fix:
a truncated policy model folder (it passed `validate`, then a 224-line traceback), a
symlink loop as a data path (pathlib's RuntimeError), a FIFO as a data file (`validate`
waited forever for a writer) exit 2; a checkpoint the disk has no room for exits 1,
its partial files removed and the previous checkpoint kept."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from typer.testing import CliRunner

from posttrain.config import RecipeError
from posttrain.recipes import checkpoints, loop
from posttrain.recipes.cli import app
from posttrain.recipes.data.rows import read_rows
from posttrain.recipes.loading import load_recipe
from tests.recipes.test_checkpoint_manifest import FakeLearner
from tests.test_grpo_e2e import _grpo_recipe

REPO = Path(__file__).resolve().parents[2]


def _one_error_line(got) -> str:
    lines = got.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), got.output
    return lines[0]


def test_a_truncated_policy_folder_fails_validate_in_one_line(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size // 2)  # an interrupted download
    recipe = _grpo_recipe(tmp_path, model)
    got = CliRunner().invoke(app, ["validate", str(recipe)])
    assert got.exit_code == 2
    line = _one_error_line(got)
    assert line.startswith(
        f"error: {recipe}: model.path: {weights} is truncated: {size // 2} bytes"
    )
    assert "download or save the model again" in line


@pytest.mark.parametrize("key", ["data", "eval"])
def test_a_symlink_loop_as_data_path_exits_2_in_one_line(tiny_model, tmp_path, key):
    loop_path = tmp_path / "loop.jsonl"
    loop_path.symlink_to(loop_path)
    if key == "data":
        recipe = _grpo_recipe(tmp_path, tiny_model, data={"train": {"path": "loop.jsonl"}})
        where = "data.train.path"
    else:
        evaluation = {"prompts": {"path": "loop.jsonl"}, "every_steps": 1}
        recipe = _grpo_recipe(tmp_path, tiny_model, eval=evaluation)
        where = "eval.prompts.path"
    got = CliRunner().invoke(app, ["validate", str(recipe)])
    assert got.exit_code == 2
    assert _one_error_line(got) == (
        f"error: {recipe}: {where}: {loop_path} is a symlink loop (a link that leads back "
        "to itself); point the link at the data file, or give the file's own path"
    )


def test_a_fifo_as_data_file_exits_2_at_once(tiny_model, tmp_path):
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    recipe = _grpo_recipe(tmp_path, tiny_model, data={"train": {"path": "train.jsonl"}})
    code = f"from posttrain.recipes.cli import app; app(['validate', {str(recipe)!r}])"
    try:  # it waited forever for a writer
        got = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"validate hangs on the FIFO {fifo}")
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip() == (
        f"error: {recipe}: data.train.path: {fifo} is a FIFO (named pipe), not a regular file "
        "(reading it could wait forever for a writer); give the data as a regular file"
    )


def test_the_row_reader_refuses_a_fifo_without_reading_it(tmp_path):
    """The loader's own check (a run started from Python skips the CLI's preflight)."""
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(RecipeError, match=r"^data.train: .* is a FIFO \(named pipe\)"):
        next(read_rows(fifo))


def _full_disk_after(n_ok: int, monkeypatch) -> None:
    """`write_manifest` succeeds `n_ok` times, then the disk is full."""
    real, calls = checkpoints.write_manifest, []

    def write(folder):
        calls.append(folder)
        if len(calls) > n_ok:
            (Path(folder) / "half-written").write_bytes(b"x")
            raise OSError(errno.ENOSPC, "No space left on device", str(folder))
        return real(folder)

    monkeypatch.setattr(checkpoints, "write_manifest", write)
    monkeypatch.setattr(ray, "get", lambda refs, **kw: refs)


def test_a_full_disk_at_checkpoint_time_keeps_the_previous_one(tiny_model, tmp_path, monkeypatch):
    recipe = load_recipe(_grpo_recipe(tmp_path, tiny_model))
    run_dir = tmp_path / "run"
    _full_disk_after(1, monkeypatch)
    checkpoints.save(run_dir, recipe, [FakeLearner()], 1, None, {})
    with pytest.raises(checkpoints.CheckpointFailed) as err:
        checkpoints.save(run_dir, recipe, [FakeLearner()], 2, None, {})
    assert str(err.value) == (
        f"checkpoint {run_dir / 'checkpoints' / 'step_00002'} could not be written (No space "
        "left on device); the previous checkpoint step_00001 is kept. Free space there (or "
        f"lower train.keep_checkpoints), then resume with: posttrain run --resume {run_dir}"
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00001"]
    assert checkpoints.verify(checkpoints.latest(run_dir))


def test_a_full_disk_at_checkpoint_time_exits_1_in_one_line(tiny_model, tmp_path, monkeypatch):
    recipe_file = _grpo_recipe(tmp_path, tiny_model)
    run_dir = tmp_path / "run"

    def fake_run(recipe, run_dir, *a, **k):  # the loop's first checkpoint hits a full disk
        run = SimpleNamespace(
            run_dir=run_dir, recipe=recipe, roles=SimpleNamespace(learners=[FakeLearner()])
        )
        run.prompts = run.data = None
        loop._checkpoint_if_due(run, SimpleNamespace(checkpoint_state=dict), 2, None)

    monkeypatch.setattr(checkpoints, "data_fingerprint", lambda data: None)
    monkeypatch.setattr(loop, "run", fake_run)
    _full_disk_after(0, monkeypatch)
    got = CliRunner().invoke(app, ["run", str(recipe_file), "--out", str(run_dir)])
    assert got.exit_code == 1, got.output
    line = got.output.splitlines()[-1]
    assert line.startswith("error: checkpoint ") and "(No space left on device); no " in line
    assert not any((run_dir / "checkpoints").iterdir())
