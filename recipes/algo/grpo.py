"""GRPO on the controller: group-normalised advantages and the step's updates (the
batch and metrics every rollout algorithm shares are in `rollouts.py`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ...actors.rollout import Rollout
from ...algorithms.batch import TrainBatch, concat, pad_rows_to_multiple
from ...algorithms.grpo import ESTIMATORS, GRPOLoss, mask_truncated, overlong_penalty
from ...config import Recipe
from ..controller import on_learners
from .base import RLAlgorithm, correction_of, run_updates


def logprob_mismatch(batch: TrainBatch, old_logprobs: torch.Tensor) -> float:
    """Mean |old_logprobs - inference_logprobs| over response tokens: how far the
    learner's view of the sampling policy is from the engine's (precision, kernels)."""
    m = batch.response_mask
    if batch.inference_logprobs is None or float(m.sum()) == 0:
        return 0.0
    return float(((old_logprobs - batch.inference_logprobs).abs() * m).sum() / m.sum())


class GRPO(RLAlgorithm):
    """`algorithm: grpo`: advantages of `grpo.estimator` (after DAPO's overlong penalty
    when `grpo.overlong_buffer` is set), truncated rows masked out with
    `grpo.mask_truncated`, then `epochs × mini_batches` updates of `grpo.loss` (+ k3 KL
    with `kl_coef`). With one update per step `old_logprobs` come from the update's own
    forward (see `algorithms.grpo`)."""

    name = "grpo"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        g = recipe.grpo
        self.loss = GRPOLoss(
            clip_low=g.clip_eps,
            clip_high=g.clip_eps_high or g.clip_eps,
            kl_coef=g.kl_coef,
            kind=g.loss,
            correction=correction_of(recipe),
            loss_agg=g.loss_agg,
        )
        self.estimate = ESTIMATORS[g.estimator]

    def train(
        self,
        learners: list[Any],
        batch: TrainBatch,
        rollouts: list[Rollout],
        rewards: list[float | None],
        step: int,
    ) -> dict[str, float]:
        g, t0 = self.recipe.grpo, time.time()
        reward_t = torch.tensor([math.nan if x is None else x for x in rewards])
        stats: dict[str, float] = {}
        if g.overlong_buffer is not None:
            penalty = overlong_penalty(
                torch.tensor([len(r.response_ids) for r in rollouts]),
                self.recipe.rollout.max_new_tokens,
                g.overlong_buffer,
                g.overlong_penalty,
            )
            reward_t = reward_t + penalty
            stats["overlong_penalty_mean"] = float(penalty.mean())
        adv = self.estimate(reward_t, [r.group_id for r in rollouts], g.scale_rewards, g.std_eps)
        if g.mask_truncated:
            truncated = torch.tensor([r.finish_reason == "length" for r in rollouts])
            batch.response_mask = mask_truncated(batch.response_mask, truncated)
        batch.advantages = adv.unsqueeze(-1) * batch.response_mask
        padded = pad_rows_to_multiple(batch, len(learners))
        if self.facts.old_logprob_pass:
            padded.old_logprobs = concat(
                on_learners(learners, "compute", padded, step, "old_logprobs")
            )
            stats["logprob_mismatch"] = logprob_mismatch(batch, padded.old_logprobs[: len(batch)])
        if self.facts.passes.reference_forward:
            padded.ref_logprobs = concat(
                on_learners(learners, "compute", padded, step, "ref_logprobs")
            )
        t_train = time.time()
        updates = run_updates(
            learners,
            padded,
            len(batch),
            g.epochs,
            g.mini_batches,
            self.loss.aggregation,
            self.recipe.train.seed * 7919 + step,
            step,
        )
        return {
            **updates,
            **stats,
            "time/logprobs": t_train - t0,
            "time/train": time.time() - t_train,
        }
