"""PPO on the controller side: critic values, per-token rewards with the KL penalty,
GAE and whitening, then `epochs` × `mini_batches` updates on the learner group."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from posttrain.actors.rollout import Rollout
from posttrain.learner.batch import TrainBatch, concat, pad_rows_to_multiple
from posttrain.algorithms.common import loss_denominator
from posttrain.algorithms.ppo import explained_variance, gae, masked_whiten, token_rewards
from posttrain.recipes.controller import on_learners
from posttrain.config import Recipe


def advantages_and_returns(batch: TrainBatch, scores: torch.Tensor, truncated: torch.Tensor,
                           recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw advantages, (whitened) advantages and returns, all `[B, T]`, from a batch
    holding old_logprobs, values and (with KL) ref_logprobs."""
    p, m = recipe.ppo, batch.response_mask
    kl = p.kl_coef if p.kl_mode == "reward" else 0.0
    rewards = token_rewards(scores, m, batch.old_logprobs, batch.ref_logprobs, kl)
    cols = torch.arange(m.shape[1]).expand_as(m)
    last = torch.where(m > 0, cols, torch.zeros_like(cols)).max(-1).values
    boot = batch.values.gather(1, last[:, None]).squeeze(1) * truncated.float()
    raw, returns = gae(rewards, batch.values, m, p.gamma, p.lam,
                       boot if p.bootstrap_truncated else None)
    adv = masked_whiten(raw, m) if p.whiten_advantages else raw
    return raw, adv, returns


def train_ppo(learners: list[Any], batch: TrainBatch, rollouts: list[Rollout],
              rewards: list[float | None], recipe: Recipe, step: int) -> dict[str, float]:
    """Values, GAE and the PPO updates of one step; returns step metrics."""
    import time

    t0, p = time.time(), recipe.ppo
    n = len(batch)
    padded = pad_rows_to_multiple(batch, len(learners) * p.mini_batches)
    extra = len(padded) - n
    padded.old_logprobs = concat(on_learners(learners, "compute_logprobs", padded, step))
    if p.kl_coef > 0:
        padded.ref_logprobs = concat(on_learners(learners, "compute_logprobs", padded, step, True))
    padded.values = concat(on_learners(learners, "compute_values", padded, step))
    scores = torch.tensor([x or 0.0 for x in rewards] + [0.0] * extra)
    truncated = torch.tensor([r.finish_reason == "length" for r in rollouts] + [False] * extra)
    raw, padded.advantages, padded.returns = advantages_and_returns(padded, scores, truncated,
                                                                    recipe)
    t_train, m = time.time(), padded.response_mask
    g = torch.Generator().manual_seed(recipe.train.seed * 7919 + step)
    updates = []
    for _ in range(p.epochs):
        for idx in torch.randperm(len(padded), generator=g).chunk(p.mini_batches):
            sub = padded.select(idx)
            denom = loss_denominator(sub.response_mask, "token_mean")
            updates.append(on_learners(learners, "ppo_train_step", sub, denom, step)[0])
    valid = raw[m > 0]
    stats = {k: statistics.fmean(u[k] for u in updates) for k in updates[0]}
    return {**stats, "grad_norm": updates[-1]["grad_norm"], "lr": updates[-1]["lr"],
            "explained_variance": explained_variance(padded.values, padded.returns, m),
            "advantage_mean": float(valid.mean()) if valid.numel() else 0.0,
            "advantage_std": float(valid.std()) if valid.numel() > 1 else 0.0,
            "returns_mean": float(padded.returns[m > 0].mean()) if valid.numel() else 0.0,
            "time/logprobs": t_train - t0, "time/train": time.time() - t_train}
