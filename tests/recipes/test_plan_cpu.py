"""`posttrain plan --gpu cpu`: the step model on hand-computed calibrations, the probes,
and the command on a tiny model; `plan` on every shipped recipe."""

from __future__ import annotations

import dataclasses
import math

import pytest
from typer.testing import CliRunner

from posttrain.recipes.cli import app
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.planning.cpu import (
    CpuCalibration,
    DecodeProbe,
    PushProbe,
    TrainProbe,
    learner_layouts,
    learner_seconds,
    learner_tokens,
    predict,
    worker_threads,
)
from tests.conftest import ROOT
from tests.tiny_model import build_tiny_model

QUICK = ROOT / "recipes" / "quickstart_grpo.yaml"
#: The hand values below are the quickstart's on 2 learner ranks (it leaves the layout
#: to the run, whose prediction depends on the machine).
PIN2 = ["resources.learner.gpus=2"]
CAL = CpuCalibration(
    cores=2,
    ram_bytes=24e9,
    matmul_flops={1: 50e9, 2: 100e9},
    copy_bytes_per_s=10e9,
    loopback_bytes_per_s=1e9,
    decode=DecodeProbe(
        engine="hf", threads=2, batch=32, prompt_tokens=31, steps=4, prefill_s=0.5, step_s=0.1
    ),
    train=TrainProbe(threads=1, batch=2, tokens=110, seconds=2.0),
    push=PushProbe(load_s=0.4, load_bytes=1e8, collective_s=0.002, tensors=100),
    adamw_s_per_param=5e-9,
    seconds=3.0,
)


def test_quickstart_step_by_hand():
    r = load_recipe(
        QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"]
    )  # 32 sequences, 1 engine, 2 learner ranks
    assert worker_threads(r, 2) == (2, 1)
    s = predict(r, params=1e8, trainable=1e8, prompt_tokens=31, cal=CAL)
    assert s.prefill == pytest.approx(0.5)  # the probe's own batch and prompt
    assert s.decode == pytest.approx(24 * 0.1)
    # roofline: max(2e8 B / 10 GB/s, 2·1e8·32 FLOP / 100 GFLOP/s) per token
    assert s.decode_roofline == pytest.approx(24 * 0.064)
    assert s.mfu == pytest.approx(6e8 * 110 / 2.0 / 50e9)  # 0.66
    # 32·55/2 = 880 tokens per rank at 6e8 FLOP each, 50 GFLOP/s × 0.66
    assert s.train_compute == pytest.approx(6e8 * 880 / 33e9)
    assert s.optimizer == pytest.approx(5e-9 * 1e8 / 2)  # each rank steps half
    assert s.fsdp_comm == pytest.approx(0.5 * 8 * 1e8 / 1e9)  # 1 micro-batch of 16
    # 100 all-gathers of 2 ms, half of 2e8 bytes gathered and 2e8 broadcast at 1 GB/s,
    # then the engine loads 2e8 bytes at its measured 0.4 s per 1e8
    assert s.push == pytest.approx(100 * 0.002 + (0.5 * 2e8 + 2e8) / 1e9 + 0.8)
    assert s.step == pytest.approx(2.9 + s.train + 1.3)
    assert s.rollout_idle + s.learner_idle + s.push / s.step == pytest.approx(1.0)


def test_step_scales_with_the_recipe():
    base = predict(
        load_recipe(QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"]),
        1e8,
        1e8,
        31,
        CAL,
    )
    double = predict(
        load_recipe(
            QUICK,
            [
                *PIN2,
                "rollout.engine=hf",
                "rollout.max_new_tokens=24",
                "train.prompts_per_step=8",
                "train.micro_batch_size=32",
            ],
        ),
        1e8,
        1e8,
        31,
        CAL,
    )
    assert double.decode == pytest.approx(2 * base.decode)  # batch 64 vs the probe's 32
    assert double.train_compute == pytest.approx(2 * base.train_compute)
    assert double.fsdp_comm == pytest.approx(base.fsdp_comm)  # still one micro-batch
    small_mb = predict(
        load_recipe(
            QUICK,
            [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", "train.micro_batch_size=4"],
        ),
        1e8,
        1e8,
        31,
        CAL,
    )
    assert small_mb.fsdp_comm == pytest.approx(4 * base.fsdp_comm)  # 16 rows / 4
    lora = predict(
        load_recipe(
            QUICK,
            [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", "model.adapter.type=lora"],
        ),
        1e8,
        1e6,
        31,
        CAL,
    )
    assert lora.train_compute == pytest.approx(base.train_compute * 4 / 6)
    assert lora.optimizer == pytest.approx(base.optimizer / 100)


def test_learner_tokens_count_packed_groups():
    """Quickstart: 16 rows per rank, 2 groups of 8 per micro-batch of 16; SmolLM2's sizes
    (576, 1536): packed, each group is 31 + 8·24 tokens instead of 8·(31 + 24)."""
    r = load_recipe(QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"])
    assert learner_tokens(r, 31, None, None) == 16 * 55
    assert learner_tokens(r, 31, 576, 1536) == 2 * (31 + 8 * 24)
    long = load_recipe(
        QUICK,
        [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", "rollout.max_new_tokens=4000"],
    )
    assert learner_tokens(long, 31, 576, 1536) == 16 * 4031  # dense attention: not packed
    packed = predict(r, 1e8, 1e8, 31, CAL, 576, 1536)
    assert packed.train_compute == pytest.approx(6e8 * 446 / 33e9)


def test_a_loaded_machine_is_flagged(capsys):
    """2 threads measured slower than 1 (other jobs on the cores): the plan says so."""
    from dataclasses import replace

    from posttrain.recipes.planning.cpu_view import print_cpu_plan
    from posttrain.recipes.planning.planner import ModelShape

    r = load_recipe(QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"])
    shape = ModelShape(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=4,
        head_dim=16,
        intermediate=128,
        vocab=100,
        tied=True,
    )
    for flops, flagged in (({1: 50e9, 2: 100e9}, False), ({1: 50e9, 2: 10e9}, True)):
        cal = replace(CAL, matmul_flops=flops)
        print_cpu_plan(r, shape, 31, cal, predict(r, 1e8, 1e8, 31, cal))
        assert ("other jobs are using the cores" in capsys.readouterr().out) == flagged


def test_one_rank_gathers_nothing():
    s = predict(
        load_recipe(
            QUICK,
            [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", "resources.learner.gpus=1"],
        ),
        1e8,
        1e8,
        31,
        CAL,
    )
    assert s.push == pytest.approx(2e8 / 1e9 + 0.8)  # broadcast + engine load only
    assert s.optimizer == pytest.approx(5e-9 * 1e8)


def test_probes_measure_positive_rates():
    from posttrain.recipes.planning import calibrate

    assert calibrate.measure_matmul(1, 64, 64, 64, seconds=0.01) > 0
    assert math.isfinite(calibrate.measure_copy(8 * calibrate.MIB, reps=1))
    assert calibrate.measure_loopback(4 * calibrate.MIB, calibrate.MIB) > 0
    assert 0 < calibrate.measure_collective(reps=4) < 10


def test_calibration_is_cached_per_machine_and_shape(tiny_model, monkeypatch, tmp_path):
    """The second plan reads the file the first wrote (same values); another step shape
    or --recalibrate measures again."""
    from posttrain.recipes.planning import calibration_cache as calibrate
    from posttrain.recipes.planning.planner import ModelShape

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    TINY = ModelShape.from_config(tiny_model / "config.json")  # noqa: N806
    r = load_recipe(QUICK, [*PIN2, f"model.path={tiny_model}", "rollout.engine=hf"])
    first, came_from = calibrate.cached_calibration(r, tiny_model, 12, TINY)
    assert came_from is None and first.decode.engine == "hf" and first.push.tensors > 0
    again, came_from = calibrate.cached_calibration(r, tiny_model, 12, TINY)
    assert came_from is not None and came_from.parent == tmp_path / "calibration"
    assert again == first
    other = load_recipe(
        QUICK, [*PIN2, f"model.path={tiny_model}", "rollout.engine=hf", "rollout.max_new_tokens=8"]
    )
    assert calibrate.cached_calibration(other, tiny_model, 12, TINY)[1] is None
    assert calibrate.cached_calibration(r, tiny_model, 12, TINY, recalibrate=True)[1] is None
    came_from.write_text("{not json")  # a broken file is measured again, not an error
    assert calibrate.cached_calibration(r, tiny_model, 12, TINY)[1] is None


def test_plan_cpu_cli_on_a_tiny_model(tiny_model, monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    out = CliRunner().invoke(
        app,
        [
            "plan",
            str(QUICK),
            "--gpu",
            "cpu",
            "--set",
            "resources.learner.gpus=2",
            "--set",
            f"model.path={tiny_model}",
            "--set",
            "rollout.engine=hf",
        ],
    )
    assert out.exit_code == 0, out.output
    for needle in (
        "measured in",
        "decode probe (hf engine, 32 seqs, 2 threads)",
        "engine load of",
        "step time on this CPU",
        "rollout idle",
        "memory: 2 learner ranks",
        "learner layout",
    ):
        assert needle in out.output
    again = CliRunner().invoke(
        app,
        [
            "plan",
            str(QUICK),
            "--gpu",
            "cpu",
            "--set",
            "resources.learner.gpus=2",
            "--set",
            f"model.path={tiny_model}",
            "--set",
            "rollout.engine=hf",
        ],
    )
    assert again.exit_code == 0 and "cached, measured" in again.output, again.output
    bad = CliRunner().invoke(app, ["plan", str(QUICK), "--gpu", "cpu", "--nodes", "2"])
    assert bad.exit_code == 2


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """Its tokenizer is one token per character: GSM8K and code prompts need a long
    context."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_long") / "model", max_positions=8192)


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").rglob("*.yaml")), ids=lambda p: p.name)
def test_plan_runs_on_every_shipped_recipe(path, long_tiny_model, request):
    """Every recipe plans with its data tokenized once (times: docs/benchmarks.md)."""
    if "shared/data" in path.read_text():  # its data is the repository's test data
        request.getfixturevalue("shared_data")  # skips in a checkout without it
    # A reward-model reward needs a model folder before anything starts; the tiny model's
    # folder stands in for the one recipes/rm_hh.yaml would train.
    uses_rm = "type: reward_model" in path.read_text()
    stand_in = ["--set", f"rewards.0.path={long_tiny_model}"] if uses_rm else []
    if "algorithm: distill" in path.read_text():  # the teacher another run trains
        stand_in += ["--set", f"distill.teacher={long_tiny_model}"]
    out = CliRunner().invoke(
        app,
        [
            "plan",
            str(path),
            "--set",
            f"model.path={long_tiny_model}",
            "--set",
            "rollout.engine=hf",
            *stand_in,
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "step time (s)" in out.output and "split searched over 8 devices" in out.output


def test_prompt_lengths_without_torch_match_autotokenizer(tiny_model):
    """plan and validate tokenize through PreTrainedTokenizerFast (no torch import); the
    lengths are AutoTokenizer's, as the engines see them."""
    from transformers import AutoTokenizer

    from posttrain.common.model_folder import load_tokenizer
    from posttrain.recipes.data import load_prompts
    from posttrain.recipes.preflight import longest_prompt

    r = load_recipe(
        QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24", f"model.path={tiny_model}"]
    )
    prompts = load_prompts(r.data)[:50]
    length, item = longest_prompt(tiny_model, r, prompts)
    auto = AutoTokenizer.from_pretrained(str(tiny_model))
    conv = [
        {"role": "system", "content": r.model.system_prompt},
        {"role": "user", "content": item.question},
    ]
    ids = auto.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert length == len(ids)
    fast = load_tokenizer(tiny_model)
    for p in prompts[:5]:
        conv[1]["content"] = p.question
        assert (
            fast.apply_chat_template(
                conv, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            == auto.apply_chat_template(
                conv, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )


def _unpinned(r):
    """`r` with `resources.learner` as if the recipe had not set it (1 rank by default)."""
    from posttrain.config.resources import LearnerResources

    return r.model_copy(
        update={"resources": r.resources.model_copy(update={"learner": LearnerResources()})}
    )


def test_learner_layouts_by_hand():
    r = load_recipe(QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"])
    # 32 x 55 = 1760 tokens at 6e8 FLOP; the probe: 33 GFLOP/s at 1 thread (50 GFLOP/s
    # matmul), so 66 GFLOP/s at 2 threads (100 GFLOP/s matmul)
    two = learner_seconds(r, 1e8, 1e8, 31, CAL, ranks=2)
    assert two == pytest.approx(6e8 * 880 / 33e9 + 5e-9 * 1e8 / 2 + 0.5 * 8 * 1e8 / 1e9)
    one = learner_seconds(r, 1e8, 1e8, 31, CAL, ranks=1)
    assert one == pytest.approx(6e8 * 1760 / 66e9 + 5e-9 * 1e8)  # no FSDP2 traffic
    pinned = learner_layouts(r, 1e8, 1e8, 31, CAL)  # the quickstart sets gpus: 2
    assert (pinned.ranks, pinned.threads, pinned.pinned) == (2, 1, True)
    assert pinned.seconds == {(1, 2): pytest.approx(one), (2, 1): pytest.approx(two)}
    assert "pins resources.learner.gpus: 2" in pinned.reason
    assert "predicted faster: 1 rank(s) x 2 thread(s)" in pinned.reason
    free = learner_layouts(_unpinned(r), 1e8, 1e8, 31, CAL)
    assert (free.ranks, free.threads, free.pinned) == (1, 2, False)
    assert "takes the faster" in free.reason


def test_a_tie_within_the_probe_s_spread_keeps_one_rank():
    from posttrain.recipes.planning.cpu import LAYOUT_TIE, choose_learner_layout

    r = _unpinned(load_recipe(QUICK, [*PIN2, "rollout.engine=hf"]))
    assert LAYOUT_TIE == 0.08
    # two runs' start-up predictions of the quickstart on machine H that took 2 ranks
    tie = choose_learner_layout(r, {(1, 2): 4.55, (2, 1): 4.43}, 2)
    assert (tie.ranks, tie.threads) == (1, 2)
    assert tie.reason.endswith("a tie, takes fewer ranks")
    assert (choose_learner_layout(r, {(1, 2): 4.64, (2, 1): 4.48}, 2).ranks) == 1
    # 2 ranks predicted 9% faster (4.80 > 4.43 x 1.08 = 4.7844): past the tie
    far = choose_learner_layout(r, {(1, 2): 4.80, (2, 1): 4.43}, 2)
    assert (far.ranks, far.reason.endswith("takes the faster")) == (2, True)
    assert choose_learner_layout(r, {(1, 2): 4.78, (2, 1): 4.43}, 2).ranks == 1


def test_learner_layouts_pick_ranks_when_threads_do_not_scale():
    r = _unpinned(load_recipe(QUICK, [*PIN2, "rollout.engine=hf", "rollout.max_new_tokens=24"]))
    cal = dataclasses.replace(CAL, matmul_flops={1: 50e9, 2: 60e9})
    choice = learner_layouts(r, 1e8, 1e8, 31, cal)
    # 1 rank: 6e8·1760 / (33e9·60/50) + 0.5 = 27.17 s; 2 ranks: 16 + 0.25 + 0.4 = 16.65 s
    assert choice.seconds[(1, 2)] == pytest.approx(6e8 * 1760 / 39.6e9 + 0.5)
    assert choice.seconds[(2, 1)] == pytest.approx(16.65)
    assert (choice.ranks, choice.threads) == (2, 1)
    no_rate = dataclasses.replace(CAL, matmul_flops={2: 100e9}, train=TrainProbe(2, 2, 110, 2.0))
    only = learner_layouts(r, 1e8, 1e8, 31, no_rate)
    assert set(only.seconds) == {(1, 2)} and (only.ranks, only.threads) == (1, 2)
