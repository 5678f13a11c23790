"""`GRPO.train` on the controller with the issue-17 keys: the estimator chosen by
`grpo.estimator`, truncated rows out of the loss and its denominator with
`grpo.mask_truncated`, and DAPO's overlong penalty in the reward (fake learners)."""

from __future__ import annotations

import pytest
import torch

import posttrain.recipes.algo.base as algorithm
from posttrain.actors.rollout import Rollout
from posttrain.recipes.algo.grpo import GRPO
from posttrain.recipes.algo.rollouts import rollout_batch
from posttrain.recipes.loading import load_recipe
from tests.conftest import ROOT


def _rollout(i: int, n_tokens: int, finish: str) -> Rollout:
    return Rollout(
        uid=f"g-{i}",
        group_id="g",
        prompt_ids=[1, 2],
        response_ids=[3] * n_tokens,
        inference_logprobs=[-0.5] * n_tokens,
        finish_reason=finish,
        policy_version=0,
        prompt_text="p",
        response_text="r",
    )


def _train(monkeypatch, overrides: list[str], rewards: list[float]):
    seen = []

    def fake_on_learners(learners, method, sub, step):
        seen.append(sub)
        return [{"loss": 0.0, "grad_norm": 1.0, "lr": 0.1}] * len(learners)

    monkeypatch.setattr(algorithm, "on_learners", fake_on_learners)
    recipe = load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml", ["rollout.max_new_tokens=8", *overrides]
    )
    # A: 2 tokens (stopped); B: 8 tokens (cut at max_new_tokens); C: 7 tokens (stopped)
    rollouts = [_rollout(0, 2, "stop"), _rollout(1, 8, "length"), _rollout(2, 7, "stop")]
    batch = rollout_batch(rollouts, rewards, pad_id=0)
    stats = GRPO(recipe).train([None], batch, rollouts, rewards, step=0)
    return seen[0], stats


def test_mask_truncated_leaves_the_cut_row_out_of_the_denominator(monkeypatch):
    sub, _ = _train(
        monkeypatch, ["grpo.mask_truncated=true", "grpo.estimator=rloo"], [1.0, 0.0, 0.5]
    )
    assert sub.loss_denominator == 2 + 7
    assert sub.response_mask[1].sum() == 0 and sub.advantages[1].abs().sum() == 0
    # rloo over all three rewards (the cut row's reward still counts in the baseline)
    assert sub.advantages[0, sub.response_start].item() == pytest.approx(0.75)
    assert sub.advantages[2, sub.response_start].item() == pytest.approx(0.0, abs=1e-7)


def test_overlong_penalty_enters_the_reward_before_advantages(monkeypatch):
    # L_max 8, buffer 4: lengths 2, 8, 7 → penalties 0, −1·0.5, −0.75·0.5
    sub, stats = _train(
        monkeypatch,
        ["grpo.overlong_buffer=4", "grpo.overlong_penalty=0.5", "grpo.estimator=rloo"],
        [1.0, 1.0, 1.0],
    )
    r = torch.tensor([1.0, 0.5, 0.625])
    want = [float(r[i] - (r.sum() - r[i]) / 2) for i in range(3)]
    got = [sub.advantages[i, sub.response_start].item() for i in range(3)]
    assert got == pytest.approx(want, abs=1e-6)
    assert stats["overlong_penalty_mean"] == pytest.approx(-0.875 / 3)
    assert sub.loss_denominator == 2 + 8 + 7  # nothing masked without mask_truncated


def test_gspo_step_divides_by_sequences_not_tokens(monkeypatch):
    # 3 scored rows of 2, 8 and 7 tokens: GSPO's step mean is over the 3 sequences
    sub, _ = _train(monkeypatch, ["grpo.loss=gspo"], [1.0, 0.0, 0.5])
    assert sub.loss_denominator == 3.0
    plain, _ = _train(monkeypatch, [], [1.0, 0.0, 0.5])
    assert plain.loss_denominator == 2 + 8 + 7


def test_gspo_refuses_a_token_aggregation():
    from posttrain.config import RecipeError

    with pytest.raises(RecipeError, match=r"grpo.loss_agg.*gspo.*remove grpo.loss_agg"):
        load_recipe(
            ROOT / "recipes" / "quickstart_grpo.yaml",
            ["grpo.loss=gspo", "grpo.loss_agg=seq_mean_token_sum"],
        )
