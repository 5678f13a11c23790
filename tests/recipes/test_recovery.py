"""The pieces of a learner-group restart that need no cluster (recipes/recovery.py):
which checkpoint it goes back to, and the logs rewound to that step. The restart itself
is drilled with real kills in tests/test_fault_drills_e2e.py."""

from __future__ import annotations

import json

import pytest
import yaml

from posttrain.config import RecipeError
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.monitoring.log import StepLog
from posttrain.recipes.recovery import last_good
from tests.recipes.test_checkpoints import _run_dir


def test_last_good_is_the_newest_complete_checkpoint_up_to_the_step(tmp_path, tiny_model):
    _, run_dir = _run_dir(tmp_path, tiny_model, steps_done=(2, 4, 6))
    (run_dir / "checkpoints" / ".tmp-step_00005").mkdir()  # a partial one is never taken
    assert last_good(run_dir, 5).name == "step_00004"
    assert last_good(run_dir, 6).name == "step_00006"
    assert last_good(run_dir, 1) is None
    assert last_good(tmp_path / "nowhere", 3) is None


def test_rewind_drops_the_steps_to_run_again(tmp_path, tiny_model):
    recipe, run_dir = _run_dir(tmp_path, tiny_model)
    recipe = recipe.model_copy(
        update={
            "monitor": recipe.monitor.model_copy(
                update={"tensorboard": False, "wandb_project": None}
            )
        }
    )
    log = StepLog(run_dir, recipe)
    (run_dir / "rollouts").mkdir()
    for step in range(4):
        log.record(step, {"step": step, "loss": float(step)}, [])
        (run_dir / "rollouts" / f"step_{step:05d}.jsonl").write_text("{}\n")
    # the hacking monitors' evidence of steps 1 and 3: the step run again may fire anew
    (run_dir / "hacking.jsonl").write_text('{"step": 1}\n{"step": 3}\n')
    log.rewind(2)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert (run_dir / "hacking.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(f.name for f in (run_dir / "rollouts").iterdir()) == [
        "step_00000.jsonl",
        "step_00001.jsonl",
    ]
    log.record(2, {"step": 2, "loss": 7.0}, [])  # the step again, once
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 7.0)]
    log.close()


def test_max_restarts_is_a_count(tmp_path, tiny_model):
    recipe, run_dir = _run_dir(tmp_path, tiny_model)
    assert recipe.train.max_restarts == 0
    raw = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    raw["train"]["max_restarts"] = -1
    bad = run_dir / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError, match="train.max_restarts"):
        load_recipe(bad)
