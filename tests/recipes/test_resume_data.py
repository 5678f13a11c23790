"""A checkpoint records a fingerprint of the training data (its rows as loaded), and
`posttrain run --resume` refuses data that differs, even a file replaced in place by
one of the same size, naming the file (exit 2, before anything starts), unless
`--accept-data-change` says to continue. Checkpoints are written by the loop's own
checkpoint call with stand-in learners (no Ray)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import ray
from typer.testing import CliRunner

from posttrain.recipes import checkpoints, loop
from posttrain.recipes.cli import app
from posttrain.recipes.data import load_data, prompt_stream
from posttrain.recipes.loading import load_recipe
from tests.recipes.test_checkpoint_manifest import FakeLearner
from tests.test_grpo_e2e import _grpo_recipe

ROWS = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(1, 7)]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def run_dir(tmp_path, tiny_model, monkeypatch):
    """A run on a 6-row jsonl with a checkpoint after 2 of its 4 steps, written as the
    loop writes one."""
    data = tmp_path / "train.jsonl"
    _write(data, ROWS)
    recipe = load_recipe(
        _grpo_recipe(
            tmp_path,
            tiny_model,
            data={"train": {"path": str(data)}},
            train={"steps": 4, "prompts_per_step": 2, "micro_batch_size": 2, "checkpoint_every": 2},
        )
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text((tmp_path / "tiny.yaml").read_text())
    prompts = load_data(recipe).train
    stream = prompt_stream(prompts, 2, 0)
    next(stream), next(stream)
    run = SimpleNamespace(
        run_dir=run_dir,
        recipe=recipe,
        roles=SimpleNamespace(learners=[FakeLearner()]),
        prompts=stream,
        data=prompts,
    )
    monkeypatch.setattr(ray, "get", lambda refs, **kw: refs)
    loop._checkpoint_if_due(run, SimpleNamespace(checkpoint_state=dict), 2, None)
    monkeypatch.undo()
    assert checkpoints.latest(run_dir).name == "step_00002"
    return run_dir


@pytest.fixture
def started(monkeypatch):
    calls = []
    monkeypatch.setattr(loop, "run", lambda *a, **k: calls.append(k["resume"]) or [])
    return calls


def _same_size_edit(path):
    text = path.read_text()
    edited = text.replace("What is 3 + 3?", "What is 3 + 4?").replace("#### 6", "#### 7")
    assert len(edited) == len(text) and edited != text
    path.write_text(edited)
    os.utime(path, (0, 0))  # an old mtime too: only the content tells


def _reordered(path):
    _write(path, ROWS[1:] + ROWS[:1])


@pytest.mark.parametrize("change", [_same_size_edit, _reordered], ids=["edited", "reordered"])
def test_resume_on_changed_data_exits_2_naming_the_file(change, run_dir, tmp_path, started):
    data = tmp_path / "train.jsonl"
    change(data)
    out = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert out.exit_code == 2, out.output
    assert f"data.train.path {data}" in out.output
    assert "--accept-data-change" in out.output and "6 rows" in out.output
    assert started == []

    forced = CliRunner().invoke(app, ["run", "--resume", str(run_dir), "--accept-data-change"])
    assert forced.exit_code == 0, forced.output
    assert "continuing (--accept-data-change)" in forced.output
    assert started == [run_dir / "checkpoints" / "step_00002"]


def test_resume_on_the_same_data_goes_on(run_dir, started):
    out = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert out.exit_code == 0, out.output
    assert started == [run_dir / "checkpoints" / "step_00002"]


def test_fingerprint_hand_computed():
    import hashlib

    from posttrain.recipes.data.items import PromptItem

    rows = [PromptItem(0, "1+1?", "2", origin="train.jsonl:1")]  # where it came from: not hashed
    line = (
        '{"ground_truth": "2", "messages": null, "metadata": {}, "prompt_id": 0, '
        '"question": "1+1?"}\n'
    )
    assert checkpoints.data_fingerprint(rows) == {
        "rows": 1,
        "sha256": hashlib.sha256(line.encode()).hexdigest(),
    }
