"""The `model.adapter` block and `weight_sync.adapter_mode`: defaults, bounds and the
errors that name the key and the fix."""

from __future__ import annotations

import pytest

from posttrain.config import RecipeError
from posttrain.recipes.loading import load_recipe
from tests.conftest import ROOT

QUICKSTART = ROOT / "recipes" / "quickstart_grpo.yaml"


def _load(*sets: str):
    return load_recipe(QUICKSTART, list(sets))


def test_lora_defaults_cover_attention_and_mlp():
    a = _load("model.adapter={type: lora}").model.adapter
    assert (a.r, a.alpha, a.dropout, a.use_dora, a.save_merged) == (16, 32.0, 0.0, False, False)
    assert a.target_modules == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert _load().weight_sync.adapter_mode == "merged"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.adapter={type: lora, r: 0}"], "model.adapter.r: Input should be greater than 0"),
        (["model.adapter={type: lora, dropout: 1.0}"], "model.adapter.dropout"),
        (["model.adapter={type: lora, target_modules: []}"], "model.adapter.target_modules"),
        (
            ["model.adapter={type: lora, target_modules: [q_proj, 'q.proj']}"],
            "model.adapter: target_modules: 'q.proj' is not a module name",
        ),
        (["model.adapter={type: lora, target_modules: [q_proj, q_proj]}"], "repeat"),
        (["model.adapter={r: 8}"], "model.adapter: r is set but type is 'none'"),
        (["model.adapter={type: qlora, use_dora: true}"], "model.adapter: use_dora: DoRA"),
        (["model.adapter={type: lora4}"], "model.adapter.type"),
        (
            ["weight_sync.adapter_mode=adapter"],
            "weight_sync.adapter_mode: 'adapter' sends only adapter tensors",
        ),
        (
            ["train.compile=true", "model.adapter={type: qlora}"],
            "train.compile is on with model.adapter.type 'qlora'",
        ),
    ],
)
def test_bad_adapter_blocks_name_the_key(sets, message):
    with pytest.raises(RecipeError, match=message.replace(".", r"\.").replace("'", ".")):
        _load(*sets)


def test_dora_with_lora_is_accepted():
    assert _load("model.adapter={type: lora, use_dora: true}").model.adapter.use_dora
