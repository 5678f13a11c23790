"""`posttrain run`'s learner layout at start (recipes/planning/layout.py): a pinned
recipe keeps its layout, an unpinned one takes the faster prediction when one process
holds the model, hand-computed calibrations decide, and the line says why."""

from __future__ import annotations

import dataclasses

import pytest

from posttrain.config.resources import LearnerResources
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.planning.cpu import learner_seconds
from posttrain.recipes.planning.layout import (
    PROBE_MFU,
    PROBE_ROUNDS,
    fits_one_process,
    probe_calibration,
    start_layout,
)
from posttrain.recipes.planning.shape import ModelShape
from tests.conftest import ROOT
from tests.recipes.test_plan_cpu import CAL

QUICK = ROOT / "recipes" / "quickstart_grpo.yaml"
SETS = ["rollout.engine=hf", "rollout.max_new_tokens=24"]


def _unpinned(r):
    res = r.resources.model_copy(update={"learner": LearnerResources()})
    return r.model_copy(update={"resources": res})


def test_fits_one_process_by_hand():
    # 18 bytes per parameter (fp32 master 4 + bf16 copy 2 + fp32 grads 4 + AdamW 8)
    assert fits_one_process(1e9, 36e9)  # 18 GB <= half of 36 GB
    assert not fits_one_process(1e9, 35e9)


def test_a_pinned_recipe_keeps_its_layout(tiny_model):
    r = load_recipe(QUICK, [*SETS, "resources.learner.gpus=2"])
    out, line = start_layout(r, tiny_model, 31, cores=2, calibration=CAL)
    assert out is r and line == "learner layout: 2 rank(s), pinned by resources.learner.gpus"
    cuda = _unpinned(load_recipe(QUICK, [*SETS, "resources.device=cuda"]))
    assert start_layout(cuda, tiny_model, 31, 2, CAL)[0] is cuda
    sft = _unpinned(load_recipe(ROOT / "recipes" / "sft_tool_arith.yaml"))
    out, line = start_layout(sft, tiny_model, 0, 2, CAL)
    assert out is sft and "not sft's" in line


def test_the_quickstart_leaves_the_layout_to_the_run():
    r = load_recipe(QUICK)
    assert "gpus" not in r.resources.learner.model_fields_set


def test_an_unpinned_recipe_takes_the_faster_layout(tiny_model):
    r = _unpinned(load_recipe(QUICK, SETS))
    n = ModelShape.from_config(tiny_model / "config.json").params
    # threads scale (50 -> 100 GFLOP/s): one process, no FSDP2 traffic
    one = learner_seconds(r, n, n, 31, CAL, ranks=1)
    two = learner_seconds(r, n, n, 31, CAL, ranks=2)
    assert one < two
    out, line = start_layout(r, tiny_model, 31, 2, CAL)
    assert out is r and out.resources.learner.gpus == 1
    assert line.endswith("takes the faster -> 1 rank(s) x 2 thread(s)")
    assert f"1 rank(s) x 2 thread(s) {one:.2f} s" in line
    # 2 threads only 1.2x one: two ranks of one thread each are faster
    slow = dataclasses.replace(CAL, matmul_flops={1: 50e9, 2: 60e9})
    assert learner_seconds(r, n, n, 31, slow, 2) < learner_seconds(r, n, n, 31, slow, 1)
    out, line = start_layout(r, tiny_model, 31, 2, slow)
    assert out.resources.learner.gpus == 2 and line.endswith("-> 2 rank(s) x 1 thread(s)")
    assert r.resources.learner.gpus == 1  # the given recipe is not changed


def test_a_model_one_process_cannot_hold_keeps_the_recipes_layout(tiny_model):
    r = _unpinned(load_recipe(QUICK, SETS))
    small = dataclasses.replace(CAL, matmul_flops={1: 50e9, 2: 60e9}, ram_bytes=1e3)
    out, line = start_layout(r, tiny_model, 31, 2, small)
    assert out is r and "one process would hold" in line


def test_the_short_probe(tiny_model):
    r = load_recipe(QUICK, SETS)
    shape = ModelShape.from_config(tiny_model / "config.json")
    cal = probe_calibration(r, shape, 2)
    assert set(cal.matmul_flops) == {1, 2} and all(v > 0 for v in cal.matmul_flops.values())
    assert cal.loopback_bytes_per_s > 0 and cal.adamw_s_per_param > 0
    # the train probe states PROBE_MFU of the matmul rate at every core
    rate = 6 * shape.params * cal.train.tokens / cal.train.seconds
    assert rate == pytest.approx(PROBE_MFU * cal.matmul_flops[2])


def test_the_short_probe_keeps_each_rate_s_best_round(tiny_model, monkeypatch):
    """A burst of other work during one round lowers that round only: the thread counts
    alternate and each keeps its best round."""
    from posttrain.recipes.planning import calibrate

    calls = []

    def fake(threads, m, k, n, seconds, windows=5, dtype=None):
        calls.append(threads)
        disturbed = len(calls) == 2  # the first all-core round
        return {1: 50e9, 2: 100e9}[threads] / (2 if disturbed else 1)

    monkeypatch.setattr(calibrate, "measure_matmul", fake)
    r = load_recipe(QUICK, SETS)
    cal = probe_calibration(r, ModelShape.from_config(tiny_model / "config.json"), 2)
    assert calls == [1, 2] * PROBE_ROUNDS
    assert cal.matmul_flops == {1: 50e9, 2: 100e9}
