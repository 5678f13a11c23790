"""`train.warmup_steps`: a warmup longer than the run's optimizer steps is refused (the
learning rate would never reach `train.lr`), and the schedule is exactly what the schema
says: optimizer step k (from 0) uses lr · min(1, (k + 1) / warmup_steps)."""

from __future__ import annotations

import pytest

from posttrain.config import RecipeError
from posttrain.recipes.loading import load_recipe
from tests.conftest import ROOT

QUICK = ROOT / "recipes" / "quickstart_grpo.yaml"
DPO = ROOT / "recipes" / "dpo_hh.yaml"


def test_warmup_longer_than_the_run_is_refused_naming_the_key_and_fix():
    with pytest.raises(RecipeError) as err:
        load_recipe(QUICK, ["train.warmup_steps=12", "train.steps=10"])
    text = str(err.value)
    assert "train.warmup_steps is 12" in text and "10 optimizer steps" in text
    assert "set train.warmup_steps: 10 or less" in text
    with pytest.raises(RecipeError, match="train.warmup_steps is 21"):
        load_recipe(DPO, ["train.warmup_steps=21", "train.steps=20"])


def test_warmup_up_to_the_optimizer_steps_is_accepted():
    assert load_recipe(QUICK, ["train.warmup_steps=10", "train.steps=10"]).train.warmup_steps == 10
    # 10 steps × 2 epochs × 3 mini-batches = 60 optimizer steps
    sets = ["train.steps=10", "grpo.epochs=2", "grpo.mini_batches=3"]
    assert load_recipe(QUICK, [*sets, "train.warmup_steps=60"]).train.warmup_steps == 60
    with pytest.raises(RecipeError, match="60 optimizer steps"):
        load_recipe(QUICK, [*sets, "train.warmup_steps=61"])


def test_schedule_matches_the_schema_text():
    from posttrain.config.train import TrainConfig
    from posttrain.learner.settings import lr_factor

    # warmup 4: steps 0, 1, 2, 3 use lr/4, 2lr/4, 3lr/4, lr; never 0
    assert [lr_factor(k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor(k, 0) for k in range(3)] == [1.0, 1.0, 1.0]
    # the reported case: warmup 12 over 10 steps would peak at 10/12 of lr
    assert lr_factor(9, 12) * 1e-3 == pytest.approx(8.333e-4, rel=1e-4)
    text = TrainConfig.model_fields["warmup_steps"].description
    assert "lr/warmup_steps at step 0" in text and "from step warmup_steps − 1 on" in text
