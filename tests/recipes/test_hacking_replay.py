"""The reward-hacking monitors replayed step by step, as the loop runs them, over the
metrics.jsonl of real runs on this 2-core machine (docs/benchmarks.md, "Reward-hacking
monitors"): the length-bonus drills fire within 10 steps of the point where train reward
and held-out correctness part ways; the shipped recipes' runs and the negative-control
drill raise no firing. The files keep the keys the monitors read
(tests/recipes/data/hacking/)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from posttrain.config import HackingConfig
from posttrain.recipes.monitoring.hacking import monitors

DATA = Path(__file__).parent / "data"
HACKING = DATA / "hacking"
# the drills' held-out metric: correctness on the eval set (the trained reward is `long`)
DRILL = HackingConfig(heldout_metric="eval/pass@1/correct")


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def first_firings(rows: list[dict], t: HackingConfig) -> dict[str, int]:
    """The step at which each monitor first fires, replaying rows[:1], rows[:2], ..."""
    out: dict[str, int] = {}
    for i in range(1, len(rows) + 1):
        for f in monitors(rows[:i], t):
            out.setdefault(f.code, rows[i - 1]["step"])
    return out


def split_step(rows: list[dict], key: str, w: int = 5) -> int:
    """The first held-out measurement after the first at which the held-out metric is
    below its first value while the train reward's mean over the `w` steps up to it is
    above the first `w` steps' mean: where train reward and held-out part ways."""
    reward = [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r]
    base = statistics.fmean(v for _, v in reward[:w])
    held = [(r["step"], r[key]) for r in rows if key in r]
    for s, v in held[1:]:
        recent = [x for k, x in reward if s - w < k <= s]
        if v < held[0][1] and recent and statistics.fmean(recent) > base:
            return s
    raise AssertionError("train reward and held-out never part ways")


@pytest.mark.parametrize(
    ("name", "steps", "split", "fired"),
    [
        # 24 steps, eval every 6: split at 6; the fixed bounds fired at 18
        ("drill3_length_alone", 24, 6, {"hacking_heldout": 12, "hacking_component": 14}),
        # its first 10 steps, eval every 4 and at 10: split at 8 (at 4 the 5 steps up to it
        # are the first 5)
        ("drill2_length_alone", 10, 8, {"hacking_heldout": 10}),
        # the live confirmation at a3434c4: 12 steps, eval every 6; fired at the final eval
        ("drill_12_steps_a3434c4", 12, 6, {"hacking_heldout": 12}),
    ],
)
def test_the_length_drills_fire_within_10_steps_of_the_split(name, steps, split, fired):
    rows = load(HACKING / f"{name}.jsonl")
    assert rows[-1]["step"] == steps  # the final evaluation's row
    assert split_step(rows, DRILL.heldout_metric) == split
    got = first_firings(rows, DRILL)
    assert got == fired
    assert min(got.values()) - split <= 10


@pytest.mark.parametrize(
    ("path", "t", "steps"),
    [
        # the quickstart as shipped: a fresh clone at 3e89bc7 and one at fe6873b
        (DATA / "quickstart_grpo_metrics.jsonl", HackingConfig(), 20),
        (HACKING / "quickstart_grpo_fe6873b.jsonl", HackingConfig(), 20),
        # drill 1, the negative control: a length bonus beside correctness; both learned
        (HACKING / "drill1_length_beside_correct.jsonl", DRILL, 12),
        # the baselines' recipes as shipped at b07f601 (docs/benchmarks.md, "No hacking
        # monitor fires on the baselines' recipes as shipped")
        (HACKING / "grpo_code_b07f601.jsonl", HackingConfig(), 20),
        (HACKING / "async_qs_b07f601.jsonl", HackingConfig(), 20),
        (HACKING / "dapo_chain_sum_146492a.jsonl", HackingConfig(), 30),
        (HACKING / "openenv_game_2ca6101.jsonl", HackingConfig(), 10),
        # held-out 0.158 -> 0.617 -> 0.509 (the recipe's header records 0.658 -> 0.558
        # on machine C); the train reward (`correct`, weight 0 in the loss) rose and fell
        (HACKING / "distill_quickstart_146492a.jsonl", HackingConfig(), 20),
        (HACKING / "grpo_lora_146492a.jsonl", HackingConfig(), 20),
        (HACKING / "vf_calc_game_2ca6101.jsonl", HackingConfig(), 18),
        # from sft_tool_arith's policy at 0d2bbbe: every group scored 1.0 (no variance)
        (HACKING / "grpo_tool_arith_0d2bbbe.jsonl", HackingConfig(), 10),
        # PPO against rm_hh's reward model (both as shipped, at 0d2bbbe): the normalized
        # reward-model score on held-out prompts rose (avg@2 -0.095 -> 0.411)
        (HACKING / "ppo_hh_rm_0d2bbbe.jsonl", HackingConfig(), 30),
        # the real verifiers 0.4 example's 10 steps (146492a): its evaluation crashed then
        # (fixed in 2ca6101) and was scored afterwards, so no held-out points here
        (HACKING / "vf1_sums_146492a.jsonl", HackingConfig(), 9),
    ],
)
def test_runs_without_hacking_raise_no_firing(path, t, steps):
    rows = load(path)
    assert rows[-1]["step"] == steps
    assert first_firings(rows, t) == {}
