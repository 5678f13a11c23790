"""Booleans are refused wherever the recipe takes a number (pydantic's lax mode read
`max_token_staleness: true` as 1, silently): every numeric key of every block, and
numbers inside lists; boolean keys still take booleans."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from posttrain.config import RecipeError, Strict
from posttrain.config.base import _members, _takes_bool, _takes_number
from posttrain.config.recipe import TrainConfig
from posttrain.recipes.loading import load_recipe

QUICKSTART = "recipes/quickstart_grpo.yaml"


def _blocks(cls: type = Strict) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_blocks(sub)]
    return list(dict.fromkeys(found))


def _numeric_keys() -> list[tuple[type, str, object]]:
    """(block, key, a boolean where the key takes a number): scalars and list items."""
    keys = []
    for block in _blocks():
        for name, field in block.model_fields.items():
            members = _members(field.annotation)
            if _takes_number(members) and not _takes_bool(members):
                keys.append((block, field.alias or name, True))
                continue
            inner = [
                m
                for a in members
                if getattr(a, "__origin__", None) in (list, tuple)
                for x in a.__args__
                if x is not Ellipsis
                for m in _members(x)
            ]
            if _takes_number(inner) and not _takes_bool(inner):
                keys.append((block, field.alias or name, [False]))
    return keys


NUMERIC = _numeric_keys()


def test_the_schema_has_many_numeric_keys():
    assert len(NUMERIC) > 100  # the walk finds the schema's numbers (not a vacuous test)
    assert (TrainConfig, "max_token_staleness", True) in NUMERIC


@pytest.mark.parametrize(
    "block,key,value", NUMERIC, ids=[f"{b.__name__}.{k}" for b, k, _ in NUMERIC]
)
def test_every_numeric_key_refuses_a_boolean(block, key, value):
    with pytest.raises(ValidationError) as err:
        block.model_validate({key: value})
    kinds = {(e["type"], e.get("ctx", {}).get("key")) for e in err.value.errors()}
    assert ("bool_for_number", key) in kinds, err.value


def test_max_token_staleness_true_is_refused_naming_the_key():
    with pytest.raises(RecipeError) as err:
        load_recipe(QUICKSTART, ["train.max_token_staleness=true"])
    assert "  - train.max_token_staleness: a boolean (true/false) where a number goes" in str(
        err.value
    )


@pytest.mark.parametrize(
    "override,where",
    [
        ("train.lr=true", "train.lr"),
        ("rollout.temperature=false", "rollout.temperature"),
        ("rewards.0.weight=true", "rewards.0.weight"),
        ("debug.fail_weight_push=[1, true]", "debug.fail_weight_push[1]"),
    ],
)
def test_booleans_for_numbers_name_their_key(override, where):
    with pytest.raises(RecipeError) as err:
        load_recipe(QUICKSTART, [override])
    assert f"  - {where}: a boolean (true/false) where a number goes" in str(err.value)


def test_boolean_keys_and_numbers_still_load():
    r = load_recipe(QUICKSTART, ["monitor.progress=false", "train.lr=1", "train.steps=3"])
    assert r.monitor.progress is False and r.train.lr == 1.0 and r.train.steps == 3
