"""`posttrain eval`'s target resolution and option handling, without starting anything:
which kind a folder is, which recipe it takes, and the command line's overrides."""

from __future__ import annotations

import json

import pytest
import yaml

from posttrain.config import RecipeError
from posttrain.recipes.assess.command import load_for
from posttrain.recipes.assess.targets import resolve_target


def _run_folder(tmp_path, tiny_model, final=True):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "d",
                "algorithm": "dpo",
                "model": {"path": str(tiny_model)},
                "data": {"train": {"path": str(tmp_path / "p.jsonl"), "format": "pairs"}},
                "train": {"steps": 1, "prompts_per_step": 1},
            }
        )
    )
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}))
    if final:
        (run / "final").symlink_to(tiny_model, target_is_directory=True)
    return run


def test_run_folder_resolves_to_its_final_policy_and_recipe(tmp_path, tiny_model):
    run = _run_folder(tmp_path, tiny_model)
    t = resolve_target(str(run))
    assert (t.kind, t.folder, t.recipe, t.head) == ("run", run / "final", run / "recipe.yaml", "lm")
    final = resolve_target(str(run / "final"))
    assert final.kind == "policy" and final.recipe == run / "recipe.yaml"


def test_run_folder_without_final_or_checkpoint_says_what_to_do(tmp_path, tiny_model):
    run = _run_folder(tmp_path, tiny_model, final=False)
    with pytest.raises(RecipeError, match="neither a final policy.*let the run finish"):
        resolve_target(str(run))


def test_prompts_option_replaces_the_held_out_pairs(tmp_path, tiny_model):
    run = _run_folder(tmp_path, tiny_model)
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "x", "chosen": "y", "rejected": "z"}))
    r = load_for(resolve_target(str(run)), None, [], prompts=held)
    assert r.data.heldout.path == str(held.resolve()) and r.data.heldout.format == "pairs"


def test_rewards_option_must_be_a_list(tmp_path, tiny_model):
    run = _run_folder(tmp_path, tiny_model)
    bad = tmp_path / "rewards.yaml"
    bad.write_text("name: x\n")
    with pytest.raises(RecipeError, match="YAML list of reward components"):
        load_for(resolve_target(str(run)), None, [], rewards=bad)


def test_a_reward_model_policy_is_scored_by_its_raw_score():
    """Two prompts, normalised rewards beside raw scores 1, 3 | 2 and a failed one: the
    headline is each prompt's mean raw score (2.0 and 2.0), std over the 3 scored."""
    import math
    from types import SimpleNamespace as NS

    from posttrain.recipes.assess.scoring import EvalResult, _rm_score_result

    rollouts = [NS(group_id=g) for g in ("a", "a", "b", "b")]
    scores = [
        NS(reward=-1.0, details={"rm": -1.0, "rm.raw": 1.0}),
        NS(reward=1.0, details={"rm": 1.0, "rm.raw": 3.0}),
        NS(reward=0.0, details={"rm": 0.0, "rm.raw": 2.0}),
        NS(reward=None, details={}),
    ]
    base = EvalResult("pass@1", {"pass@1": 0.25}, [0.5, 0.0], {})
    got = _rm_score_result(base, rollouts, scores, "rm")
    assert got.metric == "rm_score" and got.items == [2.0, 2.0]
    assert got.metrics["rm_score"] == 2.0 and got.metrics["rm_scored"] == 3.0
    assert math.isclose(got.metrics["rm_score_std"], math.sqrt(2 / 3), rel_tol=1e-12)
    assert got.metrics["pass@1"] == 0.25  # the other numbers stay
