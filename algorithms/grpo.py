"""GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages and the clipped
policy loss with an optional k3 KL term. Pure tensor functions.

`old_logprobs`: when a step's batch gets exactly one optimizer step, the policy that
sampled is the policy being trained (up to precision), so the ratio is 1 at the only
update and the clip cannot act. The learner then skips the separate no-grad pass:
`micro_batch.old_logprobs` is None and the loss takes the forward's own logprobs,
detached, as `old_logprobs` (the gradient is the same: ∇ratio = ∇logprobs at ratio 1),
and reports `logprob_mismatch` against `inference_logprobs` from that forward. With
several updates per step the controller computes `old_logprobs` first and the clip
acts from the second update on.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.common import (
    LossOutput,
    aggregate_loss,
    clipped_policy_loss,
    masked_sum,
    ratio_of,
)


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


@dataclass(frozen=True)
class GRPOLoss:
    """Plain settings of the GRPO loss (from the recipe's `grpo:` block).

    Attributes:
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO's
            clip-higher when they differ).
        kl_coef: weight of the k3 KL to the reference (`ref_logprobs` must be given).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0


def loss(logprobs: torch.Tensor, mb: TrainBatch, cfg: GRPOLoss,
         values: torch.Tensor | None = None) -> LossOutput:
    """The GRPO objective of one micro-batch (DeepSeekMath eq. 3, token-level).

    Args:
        logprobs: `[b, T]` policy logprobs with gradients (0 off the response).
        mb: the micro-batch: `advantages [b, T]`, `response_mask [b, T]`,
            `loss_denominator`, optionally `old_logprobs`, `ref_logprobs`,
            `inference_logprobs` (all `[b, T]`).
        cfg: clip range and KL weight.
        values: unused (GRPO has no critic).

    Returns:
        LossOutput with sums `loss`, `clipped`, `kl`, `tokens` and, when `old_logprobs`
        come from this forward, `mismatch` (Σ|logprobs − inference_logprobs|).
    """
    fused = mb.old_logprobs is None
    old = logprobs.detach() if fused else mb.old_logprobs
    terms = clipped_policy_loss(logprobs, old, mb.advantages, cfg.clip_low, cfg.clip_high,
                                ref_logprobs=mb.ref_logprobs, kl_coef=cfg.kl_coef)
    m = mb.response_mask
    total = aggregate_loss(terms.loss, m, mb.loss_denominator)
    sums = {"loss": float(total.detach()), "clipped": masked_sum(terms.clipped, m),
            "kl": masked_sum(terms.kl, m), "tokens": float(m.sum())}
    if fused and mb.inference_logprobs is not None:
        sums["mismatch"] = masked_sum((logprobs - mb.inference_logprobs).abs(), m)
    return LossOutput(total, sums)


def finish_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Step metrics from the summed `loss` sums: loss, clip_fraction, kl and (fused
    old logprobs) logprob_mismatch, per response token."""
    out = {"loss": sums.get("loss", 0.0), "clip_fraction": ratio_of(sums, "clipped", "tokens"),
           "kl": ratio_of(sums, "kl", "tokens")}
    if "mismatch" in sums:
        out["logprob_mismatch"] = ratio_of(sums, "mismatch", "tokens")
    return out
