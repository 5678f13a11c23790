"""GRPO's math as pure tensor functions: advantages, the clipped policy loss, the KL
estimator, and loss aggregation. No model, config or process group in here, so each
piece is tested on hand-computed tensors.

Shapes: B sequences, T token columns. `response_mask [B, T]` is 1 on tokens the loss
counts (response tokens, including a final EOS and the tokens of truncated
responses) and 0 on prompt and padding.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_sum"]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable],
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages (GRPO: Shao et al. 2024, DeepSeekMath, eq. 3 outcome
    supervision): A_i = (r_i - mean(r_g)) / (std(r_g) + eps), with the unbiased std;
    without `scale_by_std`, A_i = r_i - mean(r_g) (Dr. GRPO, Liu et al. 2025).

    Groups are found by `group_ids`, never by position. Rewards that are NaN (a failed
    score) take no part in their group's statistics and get advantage 0; the caller
    also masks them out of the loss. A group with one valid sample gets 0.

    Args:
        rewards: `[N]` float rewards, NaN for a failed score.
        group_ids: N hashable ids; equal ids form one group.
        scale_by_std: divide by the group std plus `eps`.
        eps: added to the std (not a floor on the variance), so equal rewards give 0.

    Returns:
        `[N]` float32 advantages.

    Raises:
        ValueError: `rewards` is not 1-D or its length differs from `group_ids`.
    """
    if rewards.dim() != 1 or rewards.numel() != len(group_ids):
        raise ValueError(
            f"rewards must be [N] with N == len(group_ids); got {tuple(rewards.shape)} "
            f"and {len(group_ids)} ids"
        )
    r = rewards.detach().to(torch.float64)
    adv = torch.zeros_like(r)
    index: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    for members in index.values():
        idx = torch.tensor(members)
        vals = r[idx]
        valid = ~torch.isnan(vals)
        if int(valid.sum()) < 2:
            continue
        centred = torch.where(valid, vals - vals[valid].mean(), torch.zeros_like(vals))
        if scale_by_std:
            centred = centred / (vals[valid].std(unbiased=True) + eps)
        adv[idx] = centred
    return adv.to(torch.float32)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of `targets` under softmax(logits / temperature), in float32.

    The rollout engine reports `inference_logprobs` under the same temperature, so the
    importance ratio on unchanged weights is 1.

    Args:
        logits: `[B, T, V]` scores whose position t predicts `targets[:, t]`.
        targets: `[B, T]` token ids.
        temperature: sampling temperature (> 0).

    Returns:
        `[B, T]` float32 logprobs.
    """
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with
    d = ref_logprobs - logprobs (Schulman 2020, "Approximating KL divergence").
    Unbiased and non-negative. `[B, T]` in, `[B, T]` out; d is clamped to ±20 so a
    single outlier token cannot overflow.
    """
    d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


@dataclass
class PolicyLossTerms:
    """Per-token terms of the GRPO objective, all `[B, T]` float32.

    Attributes:
        loss: -min(ratio·A, clip(ratio)·A) + kl_coef·k3, to be aggregated with the mask.
        clipped: 1.0 where the clipped branch was taken (the ratio left its trust region
            in the direction the advantage pushes it), else 0.0.
        kl: k3 KL per token (zeros when no reference is given).
        ratio: exp(logprobs - old_logprobs).
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> PolicyLossTerms:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) per token, as GRPO uses it,
    plus an optional k3 KL penalty to the reference (DeepSeekMath eq. 3).

    Args:
        logprobs: `[B, T]` current policy logprobs (carry gradients).
        old_logprobs: `[B, T]` logprobs of the policy that sampled, detached.
        advantages: `[B]` (one per sequence, broadcast over tokens) or `[B, T]`.
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high].
        ref_logprobs: `[B, T]` reference logprobs, or None for no KL term.
        kl_coef: weight of the KL term.

    Returns:
        PolicyLossTerms, each `[B, T]`; masking and aggregation are the caller's.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float()
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs)
        loss = loss + kl_coef * kl
    else:
        kl = torch.zeros_like(loss)
    return PolicyLossTerms(loss=loss, clipped=was_clipped, kl=kl, ratio=ratio.detach())


def loss_denominator(response_mask: torch.Tensor, mode: LossAgg) -> float:
    """The normaliser of a whole step's loss, computed once over every sequence of the
    step (all micro-batches, all ranks) so micro-batch size cannot change the loss.

    token_mean: number of response tokens. seq_mean_token_sum: number of sequences with
    at least one response token. Never 0 (an all-masked step divides by 1).

    Args:
        response_mask: `[B, T]` mask of the whole step.
    """
    if mode == "token_mean":
        n = float(response_mask.sum())
    elif mode == "seq_mean_token_sum":
        n = float((response_mask.sum(-1) > 0).sum())
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return max(n, 1.0)


def aggregate_loss(
    per_token: torch.Tensor, response_mask: torch.Tensor, denominator: float
) -> torch.Tensor:
    """Sum of masked per-token terms over the step-wide `denominator` (see
    `loss_denominator`). Summing this over the micro-batches of a step gives the step's
    mean exactly, whatever the micro-batch size. `[B, T]` in, scalar out.
    """
    return (per_token * response_mask).sum() / denominator
