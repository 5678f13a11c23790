"""Finding checkpoints and the resume rules, on fabricated run folders (no training):
partial folders are never picked, a used --out says how to resume, and a resume that
changes what it cannot exits 2 naming the key before anything starts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from posttrain.config import RecipeError
from posttrain.recipes import checkpoints
from posttrain.recipes.cli import app
from posttrain.recipes.loading import dump_recipe, load_recipe
from tests.test_grpo_e2e import _grpo_recipe


def _run_dir(tmp_path, tiny_model, steps_done=(2,)):
    """A run folder with a recipe and complete checkpoints after `steps_done` steps."""
    recipe = load_recipe(_grpo_recipe(tmp_path, tiny_model))  # 2 steps
    run_dir = tmp_path / "run"
    for n in steps_done:
        folder = run_dir / "checkpoints" / f"step_{n:05d}"
        folder.mkdir(parents=True)
        (folder / "recipe.yaml").write_text(dump_recipe(recipe))
        (folder / checkpoints.STATE_FILE).write_text(json.dumps({"step": n}))
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    return recipe, run_dir


def test_latest_skips_partial_folders(tmp_path, tiny_model):
    _, run_dir = _run_dir(tmp_path, tiny_model, steps_done=(2, 10))
    (run_dir / "checkpoints" / ".tmp-step_00012").mkdir()  # being written
    (run_dir / "checkpoints" / "step_00014").mkdir()  # no trainer_state.json
    assert checkpoints.latest(run_dir).name == "step_00010"
    assert [p.name for p in checkpoints.complete(run_dir)] == ["step_00002", "step_00010"]


def test_resume_changes_name_the_key(tmp_path, tiny_model):
    saved = load_recipe(_grpo_recipe(tmp_path, tiny_model))
    ok = saved.model_copy(
        update={
            "train": saved.train.model_copy(update={"steps": 9}),
            "monitor": saved.monitor.model_copy(update={"progress": True}),
        }
    )
    assert checkpoints.resume_changes(saved, ok) == [
        "monitor.progress: False → True",
        "train.steps: 2 → 9",
    ]
    for update, key in [
        (
            {"train": saved.train.model_copy(update={"prompts_per_step": 5})},
            "train.prompts_per_step",
        ),
        ({"train": saved.train.model_copy(update={"lr": 0.5})}, "train.lr"),
    ]:
        with pytest.raises(RecipeError, match=key):
            checkpoints.resume_changes(saved, saved.model_copy(update=update))


def test_cli_resume_rules(tmp_path, tiny_model):
    recipe, run_dir = _run_dir(tmp_path, tiny_model)
    cli = CliRunner()
    used = cli.invoke(app, ["run", str(tmp_path / "tiny.yaml"), "--out", str(run_dir)])
    assert used.exit_code == 2 and f"posttrain run --resume {run_dir}" in used.output
    changed = cli.invoke(
        app,
        [
            "run",
            "--resume",
            str(run_dir),
            "--set",
            "rollout.samples_per_prompt=8",
            "--set",
            "train.steps=4",
        ],
    )
    assert changed.exit_code == 2 and "rollout.samples_per_prompt" in changed.output
    data = cli.invoke(app, ["run", "--resume", str(run_dir), "--set", "data.train.size=5"])
    assert data.exit_code == 2 and "data.train.size" in data.output
    done = cli.invoke(app, ["run", "--resume", str(run_dir)])  # 2 of 2 steps done
    assert done.exit_code == 2 and "--set train.steps=4" in done.output
    empty = tmp_path / "empty"
    empty.mkdir()
    none = cli.invoke(app, ["run", "--resume", str(empty)])
    assert none.exit_code == 2 and "has no recipe.yaml, so it is not a run folder" in none.output
    absent = cli.invoke(app, ["run", "--resume", str(tmp_path / "absent")])
    assert absent.exit_code == 2 and "is not a folder" in absent.output
    (empty / "recipe.yaml").write_text((tmp_path / "tiny.yaml").read_text())
    unsaved = cli.invoke(app, ["run", "--resume", str(empty)])
    assert unsaved.exit_code == 2 and "no complete checkpoint" in unsaved.output
