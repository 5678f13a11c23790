"""A LoRA on `lm_head` of a model whose head is tied to its embedding is refused at
`validate` and at the learner's start, naming the key and the fix (issue 47: it was
accepted, then every merged push and `save_merged` crashed in `merged_state_dict` with
`KeyError: attribute 'weight' already exists`; a tied model's engines cannot hold a head
that differs from the embedding). An untied head takes the LoRA."""

from __future__ import annotations

import pytest

from posttrain.config import RecipeError
from posttrain.learner import adapters
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.preflight import check_runtime_inputs
from tests.conftest import ROOT
from tests.tiny_model import build_tiny_model

FIX = "remove 'lm_head' from model.adapter.target_modules.*tie_word_embeddings: false"


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("untied") / "model", tied=False)


def _recipe(model, targets):
    return load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml",
        [
            f"model.path={model}",
            "rollout.engine=hf",
            f"model.adapter={{type: lora, target_modules: {targets}}}",
        ],
    )


def test_validate_refuses_lora_on_a_tied_head(tiny_model, untied_model):
    with pytest.raises(RecipeError, match=f"model.adapter.target_modules: 'lm_head'.*{FIX}"):
        check_runtime_inputs(_recipe(tiny_model, "[q_proj, lm_head]"))
    check_runtime_inputs(_recipe(tiny_model, "[q_proj]"))
    check_runtime_inputs(_recipe(untied_model, "[q_proj, lm_head]"))


def test_learner_refuses_lora_on_a_tied_head(tiny_model, untied_model):
    with pytest.raises(ValueError, match=f"model.adapter.target_modules: 'lm_head'.*{FIX}"):
        adapters.check_targets(str(tiny_model), ("q_proj", "lm_head"))
    adapters.check_targets(str(untied_model), ("q_proj", "lm_head"))
