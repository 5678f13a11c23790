"""Math every policy-gradient algorithm shares, as pure tensor functions: token
logprobs under a temperature, the KL estimators, the clipped surrogate, and loss
aggregation. No model, config or process group in here, so each piece is tested on
hand-computed tensors.

Shapes: B sequences, T token columns. `response_mask [B, T]` is 1 on tokens the loss
counts (response tokens, including a final EOS and the tokens of truncated
responses) and 0 on prompt and padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
"""How a step's per-token loss terms become one loss: token_mean (mean over every response
token of the step), seq_mean_token_sum (each sequence's token sum, mean over sequences;
Dr. GRPO), seq_mean_token_mean (each sequence's token mean, mean over sequences: every
sequence weighs the same whatever its length; GSPO's objective)."""


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


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) per position, in float32, without
    gradients: H = logsumexp(z) − Σ_j softmax(z)_j · z_j, z = logits / τ (the policy's
    sampling distribution; a collapsing entropy is the usual sign of a policy that stops
    exploring). `[..., V]` in, `[...]` out."""
    with torch.no_grad():
        z = logits.float() / temperature
        lse = torch.logsumexp(z, dim=-1)
        return lse - (torch.softmax(z, dim=-1) * z).sum(-1)


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

    token_mean: number of response tokens. seq_mean_token_sum and seq_mean_token_mean:
    number of sequences with at least one response token. Never 0 (an all-masked step
    divides by 1).

    Args:
        response_mask: `[B, T]` mask of the whole step.

    Raises:
        ValueError: an unknown mode.
    """
    if mode == "token_mean":
        n = float(response_mask.sum())
    elif mode in ("seq_mean_token_sum", "seq_mean_token_mean"):
        n = float((response_mask.sum(-1) > 0).sum())
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return max(n, 1.0)


def token_weights(response_mask: torch.Tensor, mode: LossAgg) -> torch.Tensor:
    """Each token's weight in the step's loss numerator, `[B, T]`: the mask, or for
    seq_mean_token_mean the mask over its row's response-token count (so a sequence's
    weights sum to 1). Computed per row, so any split of rows into micro-batches or ranks
    gives the same weights."""
    if mode == "seq_mean_token_mean":
        return response_mask / response_mask.sum(-1, keepdim=True).clamp(min=1.0)
    return response_mask


def aggregate_loss(
    per_token: torch.Tensor, weights: torch.Tensor, denominator: float
) -> torch.Tensor:
    """Sum of weighted per-token terms over the step-wide `denominator` (see
    `loss_denominator`). Summing this over the micro-batches of a step gives the step's
    mean exactly, whatever the micro-batch size. `[B, T]` in, scalar out.

    Args:
        weights: `[B, T]` the response mask, or `token_weights(mask, mode)`.
    """
    return (per_token * weights).sum() / denominator


@dataclass
class LossOutput:
    """What every algorithm's `loss(logprobs, micro_batch, cfg, values)` returns.

    Attributes:
        loss: scalar with gradients, this micro-batch's share of the step loss: summed
            over every micro-batch and rank it is the step's loss (each loss divides by
            `micro_batch.loss_denominator`, the step-wide normaliser).
        sums: metric numerators and counts (plain floats), summed over micro-batches and
            ranks by the learner and turned into step metrics by the algorithm's
            `finish_metrics`.
    """

    loss: torch.Tensor
    sums: dict[str, float] = field(default_factory=dict)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Sum of `x` where `mask` is 1, as a float (`[B, T]` in)."""
    return float((x.detach() * mask).sum())


def ratio_of(sums: dict[str, float], key: str, count: str) -> float:
    """`sums[key] / sums[count]`, with an empty count read as 1 (an all-masked step)."""
    return sums.get(key, 0.0) / max(sums.get(count, 0.0), 1.0)
