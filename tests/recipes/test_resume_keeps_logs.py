"""A resume drops the steps logged after its checkpoint (they run again) only once the
checkpoint has loaded: a resume that fails while loading (the learners' set-up, the
controller's RNG file) leaves metrics.jsonl, spans.jsonl and rollouts/ as they were.
No Ray: the roles are stand-ins."""

from __future__ import annotations

import json

import pytest

from posttrain.recipes import controller, loop
from posttrain.recipes.loading import dump_recipe, load_recipe
from posttrain.recipes.placement import Placement
from tests.test_grpo_e2e import _grpo_recipe


def _logged_run(tmp_path, tiny_model):
    """A run folder whose newest checkpoint holds 1 step and whose logs hold steps 0-2
    (the process stopped after logging step 2, before its next checkpoint)."""
    recipe = load_recipe(_grpo_recipe(tmp_path, tiny_model, train={"steps": 4, **_TRAIN}))
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step_00001"
    ckpt.mkdir(parents=True)
    (ckpt / "recipe.yaml").write_text(dump_recipe(recipe))
    (ckpt / "trainer_state.json").write_text(
        json.dumps({"step": 1, "policy_version": 1, "data": None, "algorithm": {}})
    )
    (ckpt / "controller_rng.pt").write_bytes(b"\x80\x02truncated")
    (run_dir / "rollouts").mkdir()
    for step in range(3):
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": 0.5 + step}) + "\n")
        with open(run_dir / "spans.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "role": "learner"}) + "\n")
        (run_dir / "rollouts" / f"step_{step:05d}.jsonl").write_text(f'{{"step": {step}}}\n')
    return recipe, run_dir, ckpt


_TRAIN = {"prompts_per_step": 3, "micro_batch_size": 2, "lr": 1e-3}


def _files(run_dir):
    return {
        name: (run_dir / name).read_text()
        for name in (
            "metrics.jsonl",
            "spans.jsonl",
            *(f"rollouts/step_{s:05d}.jsonl" for s in range(3)),
        )
        if (run_dir / name).exists()
    }


def _learners_fail(*args, **kwargs):
    raise RuntimeError("learner rank 0: loading checkpoints/step_00001/learner failed")


def _roles_start(*args, **kwargs):
    return controller.Roles(learners=[], placement=Placement())


@pytest.mark.parametrize(
    "start_roles, error",
    [(_learners_fail, "step_00001/learner failed"), (_roles_start, None)],
    ids=["learner_setup", "controller_rng"],
)
def test_failed_resume_deletes_nothing(start_roles, error, tiny_model, tmp_path, monkeypatch):
    recipe, run_dir, ckpt = _logged_run(tmp_path, tiny_model)
    before = _files(run_dir)
    assert len(before) == 5
    monkeypatch.setattr(controller, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(controller, "start_roles", start_roles)
    with pytest.raises(Exception, match=error):  # noqa: B017  (the loader's own error)
        loop.run(recipe, run_dir, resume=ckpt)
    assert _files(run_dir) == before
