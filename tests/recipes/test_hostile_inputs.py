"""Hostile values of the data and `eval:` keys are refused by the schema or by
`posttrain validate` (exit 2) before anything expensive starts, naming the key and the
fix: sizes no run can use, arithmetic that cannot be made or printed, errors of
`eval.prompts` files named by their own keys, chat generators as prompts, an
evaluation schedule that skips the trained policy, ground-truth advice per source."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import RecipeError
from posttrain.recipes.loading import load_recipe

QUICKSTART = Path(__file__).parents[2] / "recipes" / "quickstart_grpo.yaml"


def _refused(overrides: list[str], recipe: Path = QUICKSTART) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, overrides)
    return str(e.value)


SIZES = {
    "arithmetic": (["data.train.size=1000000000"], "data.train.size: size is 1,000,000,000"),
    "eval arithmetic": (["eval.prompts.size=1000000000"], "eval.prompts.size: size is"),
    "tool_chats": (
        [
            "algorithm=sft",
            "rewards=[]",
            "eval=null",
            "data.train={generator: tool_chats, size: 1000000000}",
        ],
        "data.train.size: size is 1,000,000,000",
    ),
    "reasoning_gym": (
        ["data.train={reasoning_gym: leg_counting, size: 1000000000}"],
        "data.train.size: size is 1,000,000,000, more than the 1,000,000 problems "
        "reasoning_gym leg_counting",
    ),
    "mixture size": (
        ["data.train={mixture: [{generator: arithmetic, size: 10}], size: 1000000000}"],
        "data.train.size: size is 1,000,000,000, more than the 1,000,000 problems a mixture",
    ),
    "mixture entry": (
        ["eval.prompts={mixture: [{reasoning_gym: leg_counting, size: 2000000}]}"],
        "eval.prompts.mixture.0.size: size is 2,000,000",
    ),
    "mixture total": (
        [
            "data.train={mixture: [{generator: arithmetic, size: 900000}, "
            "{reasoning_gym: leg_counting, size: 900000}]}"
        ],
        "data.train: the mixture's generated sources make 1,800,000 problems together",
    ),
}


@pytest.mark.parametrize("case", sorted(SIZES))
def test_a_size_no_run_can_use_is_refused_naming_key_and_limit(case):
    overrides, needle = SIZES[case]
    got = _refused(overrides)
    assert needle in got and "held in memory" in got and "1,000,000 or less" in got, got


def test_the_largest_allowed_size_validates_without_generating():
    r = load_recipe(QUICKSTART, ["data.train.size=1000000"])
    assert r.data.train.size == 1_000_000


ARITHMETIC = {
    "digits": (["data.train.max_digits=1000000000"], "data.train.max_digits: Input should be"),
    "terms": (["data.train.max_terms=1000000000"], "data.train.max_terms: Input should be"),
    "division": (
        ["data.train.operators=['/']", "data.train.max_digits=8"],
        "max_digits is 8 with operator '/'",
    ),
    "product": (
        ["data.train.operators=['*']", "data.train.max_terms=100", "data.train.max_digits=100"],
        "max_terms × max_digits is 10000 with operator '*'",
    ),
    "size true": (["data.train.size=true"], "data.train.size: Input should be a valid integer"),
    "k true": (["eval.k=true"], "eval.k: Input should be a valid integer"),
}


@pytest.mark.parametrize("case", sorted(ARITHMETIC))
def test_arithmetic_that_would_hang_or_crash_is_refused(case):
    overrides, needle = ARITHMETIC[case]
    assert needle in _refused(overrides)
