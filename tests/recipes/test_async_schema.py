"""Schema of `train.max_staleness` / `train.correction`: the defaults are today's loop,
refused combinations exit 2 naming the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from posttrain.recipes.cli import app
from posttrain.recipes.loading import load_recipe
from tests.conftest import ROOT

QUICKSTART = ROOT / "recipes" / "quickstart_grpo.yaml"


def test_defaults_are_synchronous_and_uncorrected():
    r = load_recipe(QUICKSTART)
    assert r.train.max_staleness == 0 and r.train.correction.mode == "none"
    assert r.resources.rollout_cores is None


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (["rollout.top_p=0.9", "train.correction.mode=tis"], ["rollout.top_p", "train.correction"]),
        (
            ["train.max_staleness=1", "grpo.dynamic_sampling=true"],
            ["train.max_staleness", "grpo.dynamic_sampling"],
        ),
        (["train.correction.cap=1.0"], ["cap"]),
        (
            ["train.max_staleness=1", "train.max_restarts=1"],
            ["train.max_staleness", "train.max_restarts"],
        ),
    ],
)
def test_refused_combinations_exit_2_naming_the_keys(sets, named):
    args = ["validate", str(QUICKSTART)] + [a for s in sets for a in ("--set", s)]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    for key in named:
        assert key in out.output


def test_async_and_correction_accepted(tmp_path: Path):
    text = QUICKSTART.read_text().replace(
        "train: {steps: 20,",
        "train: {max_staleness: 2, correction: {mode: mis, level: sequence, cap: 3.0}, steps: 20,",
    )
    (tmp_path / "r.yaml").write_text(text)
    r = load_recipe(tmp_path / "r.yaml")  # with the quickstart's eval block
    assert r.train.max_staleness == 2 and r.train.correction.level == "sequence"
    assert r.eval is not None
