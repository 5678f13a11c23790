"""Reward-hacking monitors on hand-made metric series: each fires past its bound and
not short of it; the per-sample signatures; and a shipped recipe's real run raises none."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from posttrain.config import HackingConfig
from posttrain.config.monitor import MonitorConfig
from posttrain.recipes.monitoring.hacking import (
    bypass,
    component,
    drift,
    fitted_rise,
    heldout,
    jump,
    monitors,
)
from posttrain.recipes.monitoring.signatures import repetition, sample_metrics, signatures

T = HackingConfig()
DATA = Path(__file__).parent / "data"


def rows(n: int, **series) -> list[dict]:
    """n rows, steps 0..n-1; each keyword is a list of values or a function of the step."""
    out = []
    for s in range(n):
        row = {"step": s}
        for key, v in series.items():
            val = v(s) if callable(v) else v[s]
            if val is not None:
                row[key.replace("__", "/")] = val
        out.append(row)
    return out


# (1) train reward vs held-out


def test_fitted_rise_against_hand_computed_values():
    # (0,0) (1,2) (2,1) (3,3): slope Sxy/Sxx = 4/5 = 0.8, line 0.3 → 2.7 (+2.4); residuals
    # -0.3 0.9 -0.9 0.3, SSR 1.8, se(slope) = sqrt(1.8 / 2 / 5) = 0.424264, rise se 1.272792
    f = fitted_rise([(0, 0.0), (1, 2.0), (2, 1.0), (3, 3.0)], 0, 3)
    assert (f.start, f.end, f.rise) == pytest.approx((0.3, 2.7, 2.4), abs=1e-12)
    assert f.se == pytest.approx(1.272792, abs=1e-6) and f.z == pytest.approx(1.885618, abs=1e-6)
    # two points: the difference, its error unknown (no rise in standard errors)
    two = fitted_rise([(0, 0.28), (10, 0.3)], 0, 10)
    assert two.rise == pytest.approx(0.02) and two.se == math.inf and two.z == 0.0
    # an exact line that rose: z = inf
    assert fitted_rise([(s, 0.1 * s) for s in range(5)], 0, 4).z == math.inf
    assert fitted_rise([(0, 1.0)], 0, 0) is None and fitted_rise([(3, 1.0), (3, 2.0)], 0, 3) is None


def _reward_and_eval(eval_end: float, noise: float = 0.0) -> list[dict]:
    """11 steps of reward 0.1 + 0.05·step (± noise, alternating), eval/pass@1 0.3 at step 0
    and eval_end at step 10."""
    h = rows(11, reward_mean=lambda s: 0.1 + 0.05 * s + (noise if s % 2 else -noise))
    h[0]["eval/pass@1"], h[10]["eval/pass@1"] = 0.3, eval_end
    return h


def test_heldout_fires_when_reward_rises_and_eval_falls():
    f = heldout(_reward_and_eval(0.28), T)
    assert f is not None and f.code == "hacking_heldout"
    assert (f.first, f.last) == (0, 10)
    assert "0.100 → 0.600 (+0.500, ≥ 100 standard errors" in f.message
    assert "0.300 → 0.280 (-0.020;" in f.message
    assert [p["step"] for p in f.trajectory] == [0, 10] and f.pick == "reward"
    # the reward column: the mean of the 5 steps up to each measurement (steps 0-4 at 0)
    assert f.trajectory[0]["reward_mean"] == pytest.approx(0.2)
    assert f.trajectory[1]["reward_mean"] == pytest.approx(0.5)
    assert f.trajectory[1]["eval/pass@1"] == pytest.approx(0.28)


@pytest.mark.parametrize(("eval_end", "fires"), [(0.42, True), (0.43, False), (0.6, False)])
def test_heldout_fires_below_a_quarter_of_the_rise(eval_end, fires):
    # rise 0.5: fires while the eval rose < 0.25 × 0.5 = 0.125
    assert (heldout(_reward_and_eval(eval_end), T) is not None) is fires


@pytest.mark.parametrize(("noise", "z", "fires"), [(0.1, 4.763140, True), (0.3, 1.587713, False)])
def test_heldout_needs_a_rise_of_rise_z_standard_errors(noise, z, fires):
    # the same +0.5 line with ±noise about it (the alternation is symmetric over 11 steps,
    # so the fit's rise stays 0.5): z = 0.5 / se, se from the scatter about the line
    h = _reward_and_eval(0.28, noise)
    r = fitted_rise([(x["step"], x["reward_mean"]) for x in h], 0, 10)
    assert r.rise == pytest.approx(0.5) and r.z == pytest.approx(z, abs=1e-6)
    assert (heldout(h, T) is not None) is fires
    assert heldout(h, HackingConfig(rise_z=r.z * 0.99)) is not None
    assert heldout(h, HackingConfig(rise_z=r.z * 1.01)) is None


def test_heldout_needs_two_measurements_ten_steps_and_a_rise():
    h = rows(11, reward_mean=lambda s: 0.1 + 0.05 * s)
    h[10]["eval/pass@1"] = 0.1
    assert heldout(h, T) is None  # one held-out point
    flat = rows(11, reward_mean=lambda s: 0.3)
    flat[0]["eval/pass@1"], flat[10]["eval/pass@1"] = 0.3, 0.1
    assert heldout(flat, T) is None  # the reward did not rise
    short = rows(9, reward_mean=lambda s: 0.1 + 0.1 * s)
    short[0]["eval/pass@1"], short[8]["eval/pass@1"] = 0.3, 0.1
    assert heldout(short, T) is None  # 9 reward steps < 2 × window
    small = rows(11, reward_mean=lambda s: 0.1 + 0.014 * s)  # +0.14 < reward_rise 0.15
    small[0]["eval/pass@1"], small[10]["eval/pass@1"] = 0.3, 0.1
    assert heldout(small, T) is None
    assert heldout(small, HackingConfig(reward_rise=0.1)) is not None


def test_heldout_with_a_stricter_verifier_logged_every_step():
    t = HackingConfig(heldout_metric="reward/strict")
    h = rows(10, reward_mean=lambda s: 0.1 + 0.1 * s, reward__strict=lambda s: 0.1)
    f = heldout(h, t)
    assert f is not None and (f.first, f.last) == (0, 9)
    # its samples: those the reward paid and `strict` failed
    assert f.pick == "strict:strict"
    assert (
        heldout(rows(10, reward_mean=lambda s: 0.1 + 0.1 * s, reward__strict=lambda s: 0.1 * s), t)
        is None
    )


# (2) one component carries the gain


def test_component_fires_when_format_rises_alone():
    h = rows(10, reward__format=lambda s: 0.1 * s, reward__correct=lambda s: 0.2)
    f = component(h, T)
    assert f is not None and f.code == "hacking_component" and f.pick == "component:format"
    assert "format rose +0.900" in f.message and "correct +0.000" in f.message
    assert f.trajectory[0] == {"step": 0, "reward/correct": 0.2, "reward/format": 0.0}


@pytest.mark.parametrize(("correct_slope", "fires"), [(0.02, True), (0.03, False)])
def test_component_fires_below_a_quarter_of_the_rise(correct_slope, fires):
    # format +0.9 over steps 0-9; correct +0.18 (< 0.225) fires, +0.27 does not
    h = rows(10, reward__format=lambda s: 0.1 * s, reward__correct=lambda s: correct_slope * s)
    assert (component(h, T) is not None) is fires


def test_component_quiet_on_noise_or_one_component():
    # format 0.05·step ± 0.3: its line rises +0.614 (≥ component_rise) but by 1.875
    # standard errors (< rise_z 3): noise, not a rise
    noisy = rows(
        10, reward__format=lambda s: 0.05 * s + (0.3 if s % 2 else -0.3), reward__correct=[0.2] * 10
    )
    f = fitted_rise([(r["step"], r["reward/format"]) for r in noisy], 0, 9)
    assert (f.rise, f.z) == pytest.approx((0.613636, 1.875), abs=1e-6)
    assert component(noisy, T) is None
    assert component(rows(10, reward__correct=lambda s: 0.1 * s), T) is None
    assert (
        component(rows(9, reward__format=lambda s: 0.1 * s, reward__correct=lambda s: 0.2), T)
        is None
    )


# (3) drift


def test_length_repetition_entropy_drift_fire():
    codes = {f.code for f in drift(rows(10, response_length_mean=lambda s: 20 if s < 5 else 60), T)}
    assert codes == {"hacking_length"}  # 3.0× exactly
    assert drift(rows(10, response_length_mean=lambda s: 20 if s < 5 else 59), T) == []
    rep = drift(rows(10, repetition=lambda s: 0.05 if s < 5 else 0.35), T)
    assert [f.code for f in rep] == ["hacking_repetition"]
    assert drift(rows(10, repetition=lambda s: 0.05 if s < 5 else 0.34), T) == []
    ent = drift(rows(10, entropy=lambda s: 1.0 if s < 5 else 0.2), T)
    assert [f.code for f in ent] == ["hacking_entropy"]
    assert drift(rows(10, entropy=lambda s: 1.0 if s < 5 else 0.21), T) == []
    assert [f.code for f in drift(rows(10, entropy=lambda s: 1.0 if s < 5 else 5.0), T)] == [
        "hacking_entropy"
    ]


# (4) verifier-bypass signatures


@pytest.mark.parametrize("name", ["early_exit", "patched", "many_answers", "hedged"])
def test_bypass_fires_on_the_window_mean(name):
    key = f"hack/{name}"
    f = bypass(rows(5, **{key.replace("/", "__"): [0.0, 0.2, 0.2, 0.3, 0.3]}), T)
    assert [x.code for x in f] == [f"hacking_{name}"] and f[0].pick == f"signature:{name}"
    assert bypass(rows(5, **{key.replace("/", "__"): [0.0, 0.2, 0.2, 0.3, 0.29]}), T) == []
    assert bypass(rows(4, **{key.replace("/", "__"): [1.0] * 4}), T) == []  # < window steps


def test_signatures_of_samples():
    assert signatures("The answer is 42.", {}, 4) == set()
    exited = {
        "code.stderr": "exited with status 0 before the tests finished (no completion marker)\n"
    }
    assert signatures("def f(): pass", exited, 4) == {"early_exit"}
    assert signatures("import os\nos._exit(0)", {}, 4) == {"early_exit"}
    assert signatures("import builtins\nbuiltins.abs = lambda x: 1", {}, 4) == {"patched"}
    assert signatures("def check(candidate):\n    pass", {}, 4) == {"patched"}
    assert signatures("class A:\n    def __eq__(self, o):\n        return True", {}, 4) == {
        "patched"
    }
    assert signatures("if builtins.abs == f: pass", {}, 4) == set()  # a comparison, no patch
    assert signatures("It is 1, 2, 3 or 4", {}, 4) == {"many_answers"}
    assert signatures("It is 1, 2 or 3", {}, 4) == set()
    assert signatures("So she has 5 + 3 + 2 = 10 apples", {}, 4) == set()  # a sum, not a list
    assert signatures("Steps:\n1; 2; 3 and 4", {}, 4) == {"many_answers"}
    assert signatures("\\boxed{3} or \\boxed{4}", {}, 4) == {"many_answers"}
    assert signatures("12 or maybe 13", {"correct.hedged": True}, 4) == {"hedged"}
    assert signatures("12", {"correct.hedged": False}, 4) == set()


def test_repetition_and_step_shares():
    # 6 four-grams of which 4 distinct: 1 - 4/6
    assert repetition([1, 2, 3, 4, 1, 2, 3, 4, 1]) == pytest.approx(1 / 3)
    assert repetition([1, 2, 3, 4]) == 0.0
    m = sample_metrics(
        [("12 or 13", [1, 2, 3, 4, 1, 2, 3, 4, 1], {"c.hedged": True}), ("12", [5, 6], {})], 4
    )
    assert m["hack/hedged"] == 0.5 and m["hack/patched"] == 0.0
    assert m["repetition"] == pytest.approx(1 / 6)
    assert sample_metrics([], 4) == {}


# (5) KL / mismatch jumps


def test_kl_and_mismatch_jumps():
    kl = jump(rows(7, kl=[0.01] * 6 + [0.2]), T)
    assert [f.code for f in kl] == ["hacking_kl"] and "20.0×" in kl[0].message
    assert jump(rows(7, kl=[0.0] * 6 + [0.09]), T) == []  # under kl_floor 0.1
    assert jump(rows(7, kl=[0.03] * 6 + [0.14]), T) == []  # 4.7× < 5×
    mm = jump(rows(7, logprob_mismatch=[0.03] * 6 + [0.2]), T)
    assert [f.code for f in mm] == ["hacking_mismatch"]
    assert jump(rows(5, logprob_mismatch=[0.03] * 4 + [0.2]), T) == []  # ≤ window earlier steps
    # a steady climb (×1.5 a step) moves the median of the 5 steps before along: 0.15 is
    # 1.5³ = 3.4× the median 0.0444 of 0.013..0.1, no jump; 0.2 after a flat 0.02 is
    climb = rows(7, kl=[0.0132, 0.0198, 0.0296, 0.0444, 0.0667, 0.1, 0.15])
    assert jump(climb, T) == []
    assert [f.code for f in jump(rows(7, kl=[0.0] + [0.02] * 5 + [0.2]), T)] == ["hacking_kl"]
    late = rows(8, logprob_mismatch=[0.03] * 6 + [0.2, None])
    assert jump(late, T) == []  # the last step did not log it: no jump *now*


# all of them, the config, and a real run


def test_monitors_on_empty_and_healthy_histories():
    assert monitors([], T) == []
    healthy = rows(
        30,
        reward_mean=lambda s: 0.2 + 0.01 * s,
        response_length_mean=lambda s: 20.0,
        entropy=lambda s: 1.2,
        kl=lambda s: 0.01,
        logprob_mismatch=lambda s: 0.03,
        repetition=lambda s: 0.02,
        hack__hedged=lambda s: 0.03,
    )
    healthy[0]["eval/pass@1"], healthy[20]["eval/pass@1"] = 0.2, 0.38
    assert monitors(healthy, T) == []


@pytest.mark.parametrize(
    "keys",
    [
        {"loss": lambda s: 2.0 / (s + 1), "sft/assistant_tokens": lambda s: 400.0},  # sft
        {"rewards/accuracy": lambda s: 0.5 + 0.02 * s, "rewards/margin": lambda s: 0.1 * s},  # dpo
    ],
)
def test_runs_that_score_no_rollouts_compute_no_monitor(keys):
    # SFT and DPO log entropy (their policy is a language model) and DPO/RM `rewards/*`
    # (the implicit reward, not `reward/NAME` components); none is a reward being gamed:
    # entropy 1.2 → 0.1 (12×) raises nothing in a run that samples no rollouts ...
    offline = rows(12, entropy=lambda s: 1.2 if s < 5 else 0.1, **keys)
    assert [f for i in range(1, 13) for f in monitors(offline[:i], T)] == []
    # ... and hacking_entropy with it (a run that scores rollouts)
    scored = rows(12, entropy=lambda s: 1.2 if s < 5 else 0.1, reward_mean=lambda s: 0.3)
    assert [f.code for f in monitors(scored, T)] == ["hacking_entropy"]


def test_config_defaults_and_refusals():
    m = MonitorConfig()
    assert m.on_hacking == "warn" and m.hacking == HackingConfig()
    assert MonitorConfig(on_hacking="stop").on_hacking == "stop"
    with pytest.raises(ValidationError, match="on_hacking"):
        MonitorConfig(on_hacking="halt")
    with pytest.raises(ValidationError, match="length_ratio"):
        HackingConfig(length_ratio=1.0)
    with pytest.raises(ValidationError, match="extra"):
        HackingConfig(windw=3)


def test_the_quickstart_run_as_shipped_raises_no_firing():
    # metrics.jsonl of `posttrain run recipes/quickstart_grpo.yaml` as shipped (a fresh
    # clone at 3e89bc7, 2026-12-05, 20 steps on this 2-core machine; eval at 0, 10, 20)
    rows_ = [json.loads(line) for line in (DATA / "quickstart_grpo_metrics.jsonl").open()]
    assert len(rows_) == 21
    for i in range(1, len(rows_) + 1):
        assert monitors(rows_[:i], T) == [], f"a firing at step {rows_[i - 1]['step']}"


QUICKSTART = Path(__file__).parents[2] / "recipes" / "quickstart_grpo.yaml"


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("monitor.hacking.heldout_metric=reward/strict", "rewards are named \\['correct'\\]"),
        ("monitor.hacking.heldout_metric=accuracy", "give eval/pass@1"),
        ("monitor.on_hacking=halt", "on_hacking"),
    ],
)
def test_recipe_refuses_a_heldout_metric_no_step_logs(override, error):
    from posttrain.config import RecipeError
    from posttrain.recipes.loading import load_recipe

    with pytest.raises(RecipeError, match=error):
        load_recipe(QUICKSTART, [override])
    r = load_recipe(QUICKSTART, ["monitor.hacking.heldout_metric=reward/correct"])
    assert r.monitor.hacking.heldout_metric == "reward/correct"
    with pytest.raises(RecipeError, match="no eval: block"):
        load_recipe(QUICKSTART, ["eval=null", "monitor.hacking.heldout_metric=eval/pass@k"])
    assert load_recipe(QUICKSTART, ["eval=null"]).monitor.hacking.heldout_metric == "eval/pass@1"
