"""A recipe error names the `--set` that gave the bad value, and an unknown union type
(a reward's `type`) is named at its own key with the types there are."""

from __future__ import annotations

import pytest

from posttrain.config import RecipeError
from posttrain.recipes.loading import load_recipe
from tests.conftest import ROOT

QUICK = ROOT / "recipes" / "quickstart_grpo.yaml"


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["train.steps=abc"], ("  - train.steps: ", "; from --set train.steps=abc")),
        (  # a block set whole: its inner key is named, and the block's --set
            ["data.train={generator: arithmetic, size: -1}"],
            ("  - data.train.size: ", "; from --set data.train={generator: arithmetic, size: -1}"),
        ),
        (["rewards.0.type=mathh"], ("  - rewards.0.type: ", "; from --set rewards.0.type=mathh")),
    ],
)
def test_the_set_that_gave_a_bad_value_is_named(sets, line):
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICK, ["train.lr=1e-6", *sets])
    key, by = line
    assert key in str(e.value) and str(e.value).endswith(by)
    assert "train.lr" not in str(e.value)  # a good --set is not blamed


def test_a_bad_value_in_the_file_names_no_set(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text(QUICK.read_text().replace("steps: 20", "steps: abc"))
    with pytest.raises(RecipeError) as e:
        load_recipe(bad, ["train.lr=1e-6"])
    assert "  - train.steps: " in str(e.value) and "--set" not in str(e.value)


def test_an_unknown_reward_type_is_named_at_its_key():
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICK, ["rewards=[{name: x, type: foo}]"])
    msg = str(e.value)
    assert "  - rewards.0.type: unknown 'foo'; use one of " in msg
    assert msg.endswith("; from --set rewards=[{name: x, type: foo}]")
    assert "'math'" in msg and "'http'" in msg and "Input tag" not in msg
