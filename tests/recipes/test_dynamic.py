"""DAPO dynamic sampling: flat groups dropped, rounds until enough groups have signal,
every generated group in the rollout file once."""

from __future__ import annotations

import itertools
import json

import pytest

from posttrain.actors.rollout import Rollout
from posttrain.recipes.algo.dynamic import has_signal, sample_with_signal
from posttrain.recipes.data.items import PromptItem
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from posttrain.rewards.protocol import Score
from tests.test_grpo_e2e import _grpo_recipe


def _rollout(group: str, i: int) -> Rollout:
    return Rollout(
        uid=f"{group}-{i}",
        group_id=group,
        prompt_ids=[1],
        response_ids=[2],
        inference_logprobs=[-0.5],
        prompt_text="q",
        response_text="a",
        ground_truth="1",
        finish_reason="stop",
        policy_version=0,
        metadata={},
    )


def _fake(flat: set[int]):
    """generate: 2 prompts a round, 2 samples each; score: a flat group for prompt ids
    in `flat`, rewards 0 and 1 otherwise."""
    ids = itertools.count()
    prompts = (
        [PromptItem(prompt_id=next(ids), question="q", ground_truth="1") for _ in range(2)]
        for _ in itertools.count()
    )

    def generate(items, r):
        return [_rollout(f"r{r}-p{p.prompt_id}", i) for p in items for i in range(2)]

    def score(rollouts):
        return [
            Score(
                uid=x.uid,
                reward=1.0
                if int(x.group_id.split("p")[1]) in flat
                else float(x.uid.endswith("-1")),
            )
            for x in rollouts
        ]

    return prompts, generate, score


def test_has_signal_ignores_failed_scores():
    assert has_signal([0.0, 1.0]) and not has_signal([1.0, 1.0, None]) and not has_signal([None])


def test_rounds_until_enough_groups_have_signal():
    prompts, generate, score = _fake(flat={0, 2, 3})
    got = sample_with_signal(prompts, generate, score, groups_wanted=2, max_rounds=5)
    # round 0: p0 flat, p1 kept; round 1: p2, p3 flat; round 2: p4 kept (p5 surplus)
    assert got.rounds == 3 and {r.group_id for r in got.rollouts} == {"r0-p1", "r2-p4"}
    assert got.dropped_groups == 4 and len(got.all_rollouts) == 12 == len(got.all_scores)
    assert [s.uid for s in got.scores] == [r.uid for r in got.rollouts]


def test_max_rounds_stops_and_an_all_flat_step_trains_on_its_last_round():
    prompts, generate, score = _fake(flat=set(range(100)))
    got = sample_with_signal(prompts, generate, score, groups_wanted=2, max_rounds=2)
    assert got.rounds == 2 and {r.group_id for r in got.rollouts} == {"r1-p2", "r1-p3"}
    assert got.dropped_groups == 2


def test_dynamic_sampling_is_grpo_only(tmp_path, tiny_model):
    recipe = _grpo_recipe(tmp_path, tiny_model, algorithm="ppo", grpo={"dynamic_sampling": True})
    with pytest.raises(Exception, match="grpo.dynamic_sampling"):
        load_recipe(recipe)


def test_dynamic_sampling_on_a_tiny_model(tiny_model, tmp_path):
    # math alone: a random model solves nothing, so every group is flat
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rewards=[{"name": "correct", "type": "math"}],
        grpo={"dynamic_sampling": True, "max_rounds": 2},
    )
    recipe = load_recipe(recipe_file, ["train.steps=1", "train.save_final=false"])
    history = run(recipe, tmp_path / "run")
    assert history[0]["dynamic/rounds"] == 2 and history[0]["dynamic/dropped_groups"] == 3
    saved = [json.loads(x) for x in (tmp_path / "run/rollouts/step_00000.jsonl").open()]
    assert len(saved) == 2 * 3 * 4 and len({r["uid"] for r in saved}) == 24
