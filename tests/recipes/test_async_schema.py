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
        (["train.correction.cap=1.0"], ["cap"]),
        (
            ["train.correction.mode=decoupled", "train.correction.level=sequence"],
            ["train.correction.level: token"],
        ),
        (["train.correction.mode=decoupled", "grpo.loss=cispo"], ["grpo.loss: ppo_clip"]),
        (["train.staleness_policy=budget"], ["train.max_staleness >= 1"]),
        (
            [
                "train.staleness_policy=budget",
                "train.max_staleness=1",
                "train.correction.mode=none",
            ],
            ["train.correction.mode: decoupled"],
        ),
        (
            [
                "train.staleness_policy=budget",
                "train.max_staleness=1",
                "rollout.engine=hf",
                "rollout.partial=true",
                "train.max_token_staleness=3",
            ],
            ["train.max_token_staleness: null"],
        ),
    ],
)
def test_refused_combinations_exit_2_naming_the_keys(sets, named):
    args = ["validate", str(QUICKSTART)] + [a for s in sets for a in ("--set", s)]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    for key in named:
        assert key in out.output


@pytest.mark.parametrize(
    "sets",
    [
        ["grpo.dynamic_sampling=true"],
        ["rollout.max_turns=3"],
        ["rollout.max_turns=3", "rollout.partial=true"],
        ["train.max_restarts=1"],
    ],
)
def test_staleness_accepts_dynamic_sampling_episodes_and_restarts(sets):
    """Once refused: the asynchronous loop drops flat groups, runs episodes ahead and
    restarts its producer with a restarted learner group."""
    r = load_recipe(QUICKSTART, ["train.max_staleness=1", *sets])
    assert r.train.max_staleness == 1


def test_async_and_correction_accepted(tmp_path: Path):
    text = QUICKSTART.read_text().replace(
        "train: {steps: 20,",
        "train: {max_staleness: 2, correction: {mode: mis, level: sequence, cap: 3.0}, steps: 20,",
    )
    (tmp_path / "r.yaml").write_text(text)
    r = load_recipe(tmp_path / "r.yaml")  # with the quickstart's eval block
    assert r.train.max_staleness == 2 and r.train.correction.level == "sequence"
    assert r.eval is not None


def _stale_token_gradient(recipe) -> float:
    """d loss / d logprob of one token sampled by an older policy: the engine's logprob
    is 0.5 below the learner's old one (w = e^0.5), advantage 1, the only update."""
    import torch

    from posttrain.algorithms import grpo
    from posttrain.algorithms.batch import TrainBatch
    from posttrain.recipes.algo.grpo import GRPO

    old = torch.tensor([[-1.0]])
    mb = TrainBatch(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        attention_mask=torch.ones(1, 1),
        response_mask=torch.ones(1, 1),
        response_start=0,
        old_logprobs=old,
        inference_logprobs=old - 0.5,
        advantages=torch.ones(1, 1),
        loss_denominator=1.0,
    )
    x = old.clone().requires_grad_(True)
    grpo.loss(x, mb, GRPO(recipe).loss).loss.backward()
    return x.grad.item()


def test_staleness_corrects_by_default_with_tis():
    r = load_recipe(QUICKSTART, ["train.max_staleness=1"])
    assert r.train.correction.mode == "tis" and r.train.correction.cap == 2.0
    assert _stale_token_gradient(r) == pytest.approx(-1.648721, abs=1e-6)  # −min(e^0.5, 2)
    # the synchronous loop keeps the uncorrected loss
    assert _stale_token_gradient(load_recipe(QUICKSTART)) == pytest.approx(-1.0, abs=1e-6)


def test_staleness_keeps_an_explicit_choice():
    none = load_recipe(QUICKSTART, ["train.max_staleness=2", "train.correction.mode=none"])
    assert none.train.correction.mode == "none"
    assert _stale_token_gradient(none) == pytest.approx(-1.0, abs=1e-6)
    capped = load_recipe(QUICKSTART, ["train.max_staleness=1", "train.correction.cap=1.5"])
    assert capped.train.correction.mode == "tis" and capped.train.correction.cap == 1.5
    mis = load_recipe(QUICKSTART, ["train.max_staleness=1", "train.correction.mode=mis"])
    assert mis.train.correction.mode == "mis"


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["grpo.loss=gspo"],
        ["rollout.partial=true", "rollout.engine=hf", "train.max_token_staleness=4"],
    ],
)
def test_decoupled_accepted_with_a_trust_region_loss(sets):
    r = load_recipe(QUICKSTART, ["train.max_staleness=2", "train.correction.mode=decoupled", *sets])
    assert r.train.correction.mode == "decoupled" and r.train.correction.level == "token"


def test_budget_accepted_and_drop_is_the_default():
    assert load_recipe(QUICKSTART, ["train.max_staleness=1"]).train.staleness_policy == "drop"
    r = load_recipe(QUICKSTART, ["train.max_staleness=2", "train.staleness_policy=budget"])
    assert r.train.staleness_policy == "budget" and r.train.correction.mode == "tis"


def test_decoupled_refused_without_rollouts():
    sft = ROOT / "recipes" / "sft_tool_arith.yaml"
    from posttrain.config import RecipeError

    with pytest.raises(RecipeError, match="algorithm sft samples none"):
        load_recipe(sft, ["train.correction.mode=decoupled"])


def test_staleness_with_top_p_says_the_correction_is_the_default():
    args = ["validate", str(QUICKSTART), "--set", "train.max_staleness=1"]
    out = CliRunner().invoke(app, [*args, "--set", "rollout.top_p=0.9"])
    assert out.exit_code == 2, out.output
    assert "its default with train.max_staleness" in out.output
    assert "train.correction.mode: none" in out.output


@pytest.mark.parametrize("recipe", ["dpo_hh.yaml", "rm_hh.yaml"])
def test_pair_algorithms_refuse_staleness_naming_it(recipe):
    out = CliRunner().invoke(
        app, ["validate", str(ROOT / "recipes" / recipe), "--set", "train.max_staleness=1"]
    )
    assert out.exit_code == 2, out.output
    assert "train.max_staleness is 1" in out.output and "train.correction" not in out.output


def test_sft_has_no_rollouts_to_generate_ahead_nor_to_correct():
    from pathlib import Path

    from posttrain.config import RecipeError
    from posttrain.recipes.loading import load_recipe

    sft = Path(__file__).resolve().parents[2] / "recipes" / "sft_tool_arith.yaml"
    with pytest.raises(RecipeError, match="algorithm sft trains on conversations"):
        load_recipe(sft, ["train.max_staleness=3"])
    with pytest.raises(RecipeError, match="algorithm sft samples none"):
        load_recipe(sft, ["train.correction.mode=tis"])


def test_the_async_engine_is_a_vllm_engine():
    from pathlib import Path

    from posttrain.config import RecipeError
    from posttrain.recipes.loading import load_recipe

    quick = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_grpo.yaml"
    with pytest.raises(RecipeError, match="rollout.engine is 'hf'; set rollout.engine: vllm"):
        load_recipe(quick, ["rollout.engine=hf", "rollout.vllm.async_engine=true"])


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (["train.max_staleness=1", "rollout.oversample=1.5"], "rollout.partial: true"),
        (
            [
                "train.max_staleness=1",
                "rollout.partial=true",
                "rollout.engine=hf",
                "rollout.oversample=1e9",
            ],
            "rollout.oversample: Input should be less than or equal to 4",
        ),
        (["rollout.partial=true", "rollout.oversample=2"], "train.max_staleness >= 1"),
        (
            ["train.max_staleness=2", "rollout.partial=true", "train.max_token_staleness=1"],
            "at least 2",
        ),
        (["train.max_staleness=1", "train.max_token_staleness=2"], "rollout.partial: true"),
        (
            [
                "train.max_staleness=1",
                "rollout.partial=true",
                "rollout.engine=hf",
                "train.max_token_staleness=2",
                "train.correction.mode=none",
            ],
            "train.correction.mode: tis",
        ),
        (
            [
                "train.max_staleness=1",
                "rollout.partial=true",
                "rollout.max_turns=2",
                "rollout.oversample=1.5",
            ],
            "single-turn",
        ),
        (
            [
                "train.max_staleness=1",
                "rollout.partial=true",
                "rollout.engine=vllm",
                "rollout.oversample=1.5",
            ],
            "rollout.vllm.async_engine: true",
        ),
    ],
)
def test_oversample_and_token_staleness_need_the_partial_producer(sets, named):
    """Keys that act only on the partial-rollout producer are refused elsewhere (exit 2),
    naming the key and the fix, instead of being ignored."""
    args = ["validate", str(QUICKSTART)] + [a for s in sets for a in ("--set", s)]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    assert named in " ".join(out.output.split())


def test_oversample_and_token_staleness_accepted_with_partial_rollouts():
    from posttrain.config import producer_window

    r = load_recipe(
        QUICKSTART,
        [
            "train.max_staleness=1",
            "rollout.partial=true",
            "rollout.vllm.async_engine=true",
            "rollout.oversample=1.5",
            "train.max_token_staleness=3",
        ],
    )
    assert r.train.correction.mode == "tis"
    # k × prompts_per_step × oversample, rounded up
    assert producer_window(r) == -(-r.train.prompts_per_step * 3 // 2)
    assert producer_window(load_recipe(QUICKSTART, ["train.max_staleness=2"])) == (
        2 * r.train.prompts_per_step
    )


@pytest.mark.parametrize(
    ("window", "engines", "expected"),
    [(16, 4, 8), (17, 4, 9), (0, 1, 4), (4 * 10**9, 1, 260)],
)
def test_a_partial_worker_holds_its_share_of_the_window_and_no_more_than_256(
    window, engines, expected
):
    """Ray makes a thread per unit of `max_concurrency`: a window of 4e9 (oversample
    1e9, before its bound) crashed the run with an OverflowError."""
    from posttrain.recipes.roles import RolloutSpec, rollout_concurrency

    spec = RolloutSpec(None, None, 1, partial=True, window=window, engines=engines)
    assert rollout_concurrency(spec) == expected
