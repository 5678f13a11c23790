"""PPO on the controller: old/ref logprobs and critic values, per-token rewards with
the KL penalty, GAE and whitening (`algorithms.ppo`), then `epochs × mini_batches`
updates of the clipped policy and value losses."""

from __future__ import annotations

import time
from typing import Any

import torch

from ...actors.rollout import Rollout
from ...algorithms.batch import TrainBatch, concat, pad_rows_to_multiple
from ...algorithms.ppo import PPOLoss, advantages_and_returns, explained_variance
from ...config import Recipe
from ...learner.settings import CriticSettings
from ..controller import on_learners
from .base import RLAlgorithm, correction_of, run_updates


class PPO(RLAlgorithm):
    """`algorithm: ppo` with a critic (the policy's architecture with a scalar head)."""

    name = "ppo"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        p = recipe.ppo
        # k1 in the reward (kl_mode: reward) or k3 in the loss (kl_mode: loss).
        self.loss = PPOLoss(
            clip_eps=p.clip_eps,
            cliprange_value=p.cliprange_value,
            kl_coef=p.kl_coef if p.kl_mode == "loss" else 0.0,
            correction=correction_of(recipe),
        )
        self.critic = (
            CriticSettings(path=p.critic_path, lr=p.critic_lr) if self.facts.critic else None
        )

    def train(
        self,
        learners: list[Any],
        batch: TrainBatch,
        rollouts: list[Rollout],
        rewards: list[float | None],
        step: int,
    ) -> dict[str, float]:
        p, t0 = self.recipe.ppo, time.time()
        n = len(batch)
        padded = pad_rows_to_multiple(batch, len(learners))
        extra = len(padded) - n
        padded.old_logprobs = concat(on_learners(learners, "compute", padded, step, "old_logprobs"))
        if self.facts.passes.reference_forward:
            padded.ref_logprobs = concat(
                on_learners(learners, "compute", padded, step, "ref_logprobs")
            )
        values = concat(on_learners(learners, "compute", padded, step, "values"))
        padded.values, final = values[:, :-1], values[:, -1]
        scores = torch.tensor([x or 0.0 for x in rewards] + [0.0] * extra)
        truncated = torch.tensor([r.finish_reason == "length" for r in rollouts] + [False] * extra)
        raw, padded.advantages, padded.returns = advantages_and_returns(
            padded,
            scores,
            truncated,
            final,
            p.gamma,
            p.lam,
            kl_coef=p.kl_coef if p.kl_mode == "reward" else 0.0,
            whiten=p.whiten_advantages,
            bootstrap_truncated=p.bootstrap_truncated,
        )
        t_train, m = time.time(), padded.response_mask
        stats = run_updates(
            learners,
            padded,
            n,
            p.epochs,
            p.mini_batches,
            "token_mean",
            self.recipe.train.seed * 7919 + step,
            step,
        )
        valid = raw[m > 0]
        return {
            **stats,
            "explained_variance": explained_variance(padded.values, padded.returns, m),
            "advantage_mean": float(valid.mean()) if valid.numel() else 0.0,
            "advantage_std": float(valid.std()) if valid.numel() > 1 else 0.0,
            "returns_mean": float(padded.returns[m > 0].mean()) if valid.numel() else 0.0,
            "time/logprobs": t_train - t0,
            "time/train": time.time() - t_train,
        }
