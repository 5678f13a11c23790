"""GRPO (Shao et al. 2024, DeepSeekMath) and its family: advantage estimators chosen by
`grpo.estimator` (`ESTIMATORS`: grpo, rloo, reinforce_pp), the policy loss chosen by
`grpo.loss` (`policy_losses.POLICY_LOSSES`: ppo_clip, gspo, cispo) with an optional k3
KL term, and DAPO's overlong handling (`mask_truncated`, `overlong_penalty`). Pure
tensor functions; the two dicts are the only places the names are read.

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

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from .batch import TrainBatch
from .common import (
    LossAgg,
    LossOutput,
    aggregate_loss,
    masked_sum,
    ratio_of,
    token_weights,
)
from .correction import (
    Correction,
    apply_correction,
    correction_metrics,
    mismatch_sums,
)
from .policy_losses import POLICY_LOSSES, with_kl


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
    r = rewards.detach().to(torch.float64)
    adv = torch.zeros_like(r)
    for idx in _valid_groups(r, group_ids):
        vals = r[idx]
        centred = vals - vals.mean()
        if scale_by_std:
            centred = centred / (vals.std(unbiased=True) + eps)
        adv[idx] = centred
    return adv.to(torch.float32)


def _valid_groups(rewards: torch.Tensor, group_ids: Sequence[Hashable]) -> list[torch.Tensor]:
    """Index tensors of each group's valid (non-NaN) rewards, groups of 2 or more only.

    Raises:
        ValueError: `rewards` is not 1-D or its length differs from `group_ids`.
    """
    if rewards.dim() != 1 or rewards.numel() != len(group_ids):
        raise ValueError(
            f"rewards must be [N] with N == len(group_ids); got {tuple(rewards.shape)} "
            f"and {len(group_ids)} ids"
        )
    index: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        if not torch.isnan(rewards[i]):
            index.setdefault(g, []).append(i)
    return [torch.tensor(m) for m in index.values() if len(m) >= 2]


def rloo_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable]) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", eq. 7; Kool et al. 2019): each
    sample's reward minus the mean of the *other* samples of its group,

        A_i = r_i − (1/(n−1)) Σ_{j≠i} r_j,   n = valid samples in the group.

    Rewards are first shifted by one member of the group (exact, and it cancels), so a
    group of equal rewards gives exactly 0. NaN rewards (failed scores) take no part and
    get 0, as does a group with one valid sample. `[N]` rewards and N ids in, `[N]`
    float32 out.
    """
    r = rewards.detach().to(torch.float64)
    adv = torch.zeros_like(r)
    for idx in _valid_groups(r, group_ids):
        d = r[idx] - r[idx[0]]
        adv[idx] = d - (d.sum() - d) / (len(idx) - 1)
    return adv.to(torch.float32)


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_ids: Sequence[Hashable], eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu 2025, "REINFORCE++", the -baseline variant,
    eqs. 7-8): subtract the group's mean reward, then divide by the std (unbiased, two
    passes) of those centred values over every valid sample of the batch plus `eps`:

        A_i = (r_i − mean(r_g)) / (std_batch(r − mean_g) + eps).

    Equal rewards in a group give exactly 0 (centred after a shift by one member); NaN
    rewards get 0 and are left out of the batch std. `[N]` in, `[N]` float32 out.
    """
    r = rewards.detach().to(torch.float64)
    adv = torch.zeros_like(r)
    for idx in _valid_groups(r, group_ids):
        d = r[idx] - r[idx[0]]
        adv[idx] = d - d.mean()
    valid = ~torch.isnan(r)
    if int(valid.sum()) >= 2:
        adv = adv / (adv[valid].std(unbiased=True) + eps)
    return adv.to(torch.float32)


Estimator = Callable[[torch.Tensor, Sequence[Hashable], bool, float], torch.Tensor]

ESTIMATORS: dict[str, Estimator] = {
    "grpo": group_advantages,
    "rloo": lambda rewards, ids, scale_by_std, eps: rloo_advantages(rewards, ids),
    "reinforce_pp": lambda rewards, ids, scale_by_std, eps: reinforce_pp_advantages(
        rewards, ids, eps
    ),
}
"""`grpo.estimator` → `fn(rewards [N], group_ids, scale_by_std, eps) -> [N]`; the only
place the name is read. `scale_by_std` is GRPO's alone."""


def mask_truncated(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering (Yu et al. 2025, §3.4): responses cut at the length
    limit leave the loss, numerator and token denominator alike, since the denominator is
    computed from the returned mask. `[B, T]` mask and `[B]` bool flags in, `[B, T]` out
    (a new tensor)."""
    return response_mask * (~truncated.bool()).to(response_mask.dtype).unsqueeze(-1)


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward:

        0                                      if len ≤ L_max − L_cache
        (L_max − L_cache − len) / L_cache      if L_max − L_cache < len ≤ L_max
        −1                                     if len > L_max

    times `factor`, with L_max = `max_len` (rollout.max_new_tokens) and L_cache =
    `buffer` (0 < buffer < max_len). `[N]` response lengths in, `[N]` float32 out.
    """
    start = max_len - buffer
    over = (lengths.to(torch.float32) - start).clamp(min=0.0)
    return -(over / buffer).clamp(max=1.0) * factor


def loss_aggregation(kind: str, loss_agg: LossAgg) -> LossAgg:
    """The aggregation policy loss `kind` trains with, read by the controller (the step's
    `loss_denominator`) and the loss (`token_weights`) alike.

    GSPO's objective (Zheng et al. 2025, eq. 5) is a mean over the G sequences of each
    sequence's clipped term: `seq_mean_token_mean`, whatever `grpo.loss_agg` (the schema
    refuses setting it with gspo). The token-level losses use `loss_agg`.
    """
    return "seq_mean_token_mean" if kind == "gspo" else loss_agg


@dataclass(frozen=True)
class GRPOLoss:
    """Plain settings of the GRPO loss (from the recipe's `grpo:` block).

    Attributes:
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO's
            clip-higher when they differ).
        kl_coef: weight of the k3 KL to the reference (`ref_logprobs` must be given).
        kind: the per-token policy loss, a key of `policy_losses.POLICY_LOSSES`
            (`ppo_clip`, `gspo` or `cispo`).
        correction: off-policy correction against `inference_logprobs`
            (`algorithms.correction`); mode 'none' leaves the loss untouched.
        loss_agg: the recipe's `grpo.loss_agg`; the step aggregates with
            `loss_aggregation(kind, loss_agg)` (the micro-batch's `loss_denominator` is
            computed with the same, see `aggregation`).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kind: str = "ppo_clip"
    correction: Correction = Correction()
    loss_agg: LossAgg = "token_mean"

    @property
    def aggregation(self) -> LossAgg:
        """The step's aggregation: `loss_aggregation(kind, loss_agg)`."""
        return loss_aggregation(self.kind, self.loss_agg)


def loss(
    logprobs: torch.Tensor, mb: TrainBatch, cfg: GRPOLoss, values: torch.Tensor | None = None
) -> LossOutput:
    """The GRPO objective of one micro-batch (DeepSeekMath eq. 3, token-level).

    Args:
        logprobs: `[b, T]` policy logprobs with gradients (0 off the response).
        mb: the micro-batch: `advantages [b, T]`, `response_mask [b, T]`,
            `loss_denominator`, optionally `old_logprobs`, `ref_logprobs`,
            `inference_logprobs` (all `[b, T]`).
        cfg: clip range, KL weight, the per-token loss (`kind`) and the aggregation
            (`cfg.aggregation`: GSPO's seq_mean_token_mean weighs each token 1/|y_i|, so
            its sequence-level term counts once per sequence and its KL as a token mean).
        values: unused (GRPO has no critic).

    Returns:
        LossOutput with sums `loss`, `clipped`, `kl`, `tokens`; when `old_logprobs`
        come from this forward, `mismatch` (Σ|logprobs − inference_logprobs|); with
        `inference_logprobs`, `mismatch_k3` and `mismatch_abs` (`correction.mismatch_sums`);
        with a correction, `is_weight` and `is_corrected`.
    """
    fused = mb.old_logprobs is None
    old = logprobs.detach() if fused else mb.old_logprobs
    m = mb.response_mask
    corr, extra = cfg.correction, {}
    if corr.mode == "none":  # exactly the uncorrected path
        terms = POLICY_LOSSES[cfg.kind](
            logprobs,
            old,
            mb.advantages,
            m,
            cfg.clip_low,
            cfg.clip_high,
            ref_logprobs=mb.ref_logprobs,
            kl_coef=cfg.kl_coef,
        )
        per_token = terms.loss
    else:  # the weight multiplies the policy term only, not the KL to the reference
        terms = POLICY_LOSSES[cfg.kind](
            logprobs, old, mb.advantages, m, cfg.clip_low, cfg.clip_high
        )
        policy, extra = apply_correction(terms.loss, old, mb.inference_logprobs, m, corr)
        per_token, terms.kl = with_kl(policy, logprobs, mb.ref_logprobs, cfg.kl_coef)
    total = aggregate_loss(per_token, token_weights(m, cfg.aggregation), mb.loss_denominator)
    sums = {
        "loss": float(total.detach()),
        "clipped": masked_sum(terms.clipped, m),
        "kl": masked_sum(terms.kl, m),
        "tokens": float(m.sum()),
        **extra,
    }
    if mb.inference_logprobs is not None:
        sums |= mismatch_sums(old, mb.inference_logprobs, m)
        if fused:
            sums["mismatch"] = masked_sum((logprobs - mb.inference_logprobs).abs(), m)
    return LossOutput(total, sums)


def finish_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Step metrics from the summed `loss` sums: loss, clip_fraction, kl and (fused
    old logprobs) logprob_mismatch, per response token."""
    out = {
        "loss": sums.get("loss", 0.0),
        "clip_fraction": ratio_of(sums, "clipped", "tokens"),
        "kl": ratio_of(sums, "kl", "tokens"),
    }
    if "mismatch" in sums:
        out["logprob_mismatch"] = ratio_of(sums, "mismatch", "tokens")
    return out | correction_metrics(sums)
