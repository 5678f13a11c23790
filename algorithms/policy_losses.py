"""The GRPO family's per-token policy losses, one pure tensor function each, chosen by
`grpo.loss` through `POLICY_LOSSES` (the only place that reads the name).

Every function has one signature,

    fn(logprobs [B, T], old_logprobs [B, T], advantages [B] | [B, T],
       response_mask [B, T], clip_low, clip_high, ref_logprobs, kl_coef) -> PolicyLossTerms

and returns per-token `[B, T]` terms; masking and aggregation (`loss_agg`) are the
caller's. The k3 KL to the reference is added the same way to each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .common import PolicyLossTerms, clipped_policy_loss, kl_k3

PolicyLoss = Callable[..., PolicyLossTerms]


def _per_sequence(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B]` advantages from `[B]` (as is) or `[B, T]` (mean over the response tokens)."""
    if advantages.dim() == 1:
        return advantages
    return (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def with_kl(
    loss: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`loss + kl_coef·k3` and the k3 term (zeros without a reference)."""
    if ref_logprobs is None:
        return loss, torch.zeros_like(loss)
    kl = kl_k3(logprobs, ref_logprobs)
    return loss + kl_coef * kl, kl


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> PolicyLossTerms:
    """Token-level clipped surrogate (PPO, Schulman et al. 2017, eq. 7; GRPO's default):
    `common.clipped_policy_loss` unchanged; `response_mask` is not needed."""
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        clip_low,
        clip_high,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
    )


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> PolicyLossTerms:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7): one
    importance ratio per sequence, the geometric mean of its token ratios,

        s_i = exp( (1/|y_i|) Σ_t (logprobs_t − old_logprobs_t) ),

    clipped per sequence: loss_i = −min(s_i·A_i, clip(s_i, 1 − clip_low, 1 + clip_high)·A_i).
    Each sequence's loss is put on every one of its response tokens (`[B, T]`), so the
    step's `loss_agg` weighs it; `clipped` and `ratio` are per sequence, broadcast.

    Args:
        logprobs, old_logprobs: `[B, T]` (old detached); only masked tokens count.
        advantages: `[B]` or `[B, T]` (constant over a response; its masked mean is used).
        response_mask: `[B, T]`; a row with no response token gets ratio 1 and loss
            −A·1 (masked out later anyway).
    """
    m = response_mask
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0) * m
    ratio = torch.exp(log_ratio.sum(-1) / m.sum(-1).clamp(min=1.0))  # [B]
    adv = _per_sequence(advantages, m)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    seq_loss = -torch.minimum(unclipped, clipped)
    ones = torch.ones_like(logprobs)
    loss, kl = with_kl(seq_loss.unsqueeze(-1) * ones, logprobs, ref_logprobs, kl_coef)
    was_clipped = (clipped < unclipped).float().unsqueeze(-1) * ones
    return PolicyLossTerms(
        loss=loss, clipped=was_clipped, kl=kl, ratio=ratio.detach().unsqueeze(-1) * ones
    )


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, MiniMax 2025, eqs. 4-5): the token's importance weight is
    clipped and detached, and multiplies the REINFORCE term, so no token's gradient is
    dropped by the clip:

        loss_t = −sg(clip(r_t, 1 − clip_low, 1 + clip_high)) · A · logprobs_t,
        r_t = exp(logprobs_t − old_logprobs_t).

    `clipped` is 1 where the weight was clamped. `response_mask` is not needed.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0)).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss, kl = with_kl(-weight * advantages * logprobs, logprobs, ref_logprobs, kl_coef)
    return PolicyLossTerms(loss=loss, clipped=(weight != ratio).float(), kl=kl, ratio=ratio)


POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}
