"""DPO's loss as a pure tensor function (Rafailov et al. 2023), with IPO as an option
(Azar et al. 2023). `dpo_loss` takes one logprob per reply, `[P]` for P preference
pairs; `loss` is the learner's entry point on a micro-batch of rows, where row 2i is
pair i's chosen reply and row 2i+1 its rejected one.

Per reply, sigmoid DPO uses the summed response logprobs (Rafailov et al. eq. 7). IPO
uses the mean per token by default, as its authors and TRL do, so its fixed target
margin 1/(2β) does not depend on reply length (`ipo_token_mean: false` restores sums).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .batch import TrainBatch
from .common import LossOutput, ratio_of

#: Rows of one example: a pair is its chosen row then its rejected row, and a
#: micro-batch never splits one.
ROWS_PER_EXAMPLE = 2


@dataclass
class DPOTerms:
    """Per-pair results, each `[P]`.

    Attributes:
        loss: the DPO (or IPO) loss of each pair.
        chosen_rewards: β·(policy − reference) summed logprob of the chosen reply, detached.
        rejected_rewards: the same for the rejected reply, detached.
    """

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
) -> DPOTerms:
    """DPO loss per pair.

    sigmoid (Rafailov et al. 2023, eq. 7; conservative label smoothing as in cDPO):
        h = β·[(π_c − ref_c) − (π_r − ref_r)],
        loss = −(1 − ε)·log σ(h) − ε·log σ(−h).
    ipo (Azar et al. 2023, eq. 17): loss = (h/β − 1/(2β))².

    Args:
        policy_chosen, policy_rejected: `[P]` summed response logprobs under the policy.
        ref_chosen, ref_rejected: `[P]` the same under the frozen reference.
        beta: β > 0, the strength of the implicit KL constraint.
        label_smoothing: ε in [0, 0.5), the assumed rate of flipped labels.

    Raises:
        ValueError: an unknown `loss_type`, or mismatched shapes.
    """
    shapes = {tuple(t.shape) for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1:
        raise ValueError(f"all four logprob tensors must have one shape [P], got {shapes}")
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    h = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    elif loss_type == "ipo":
        loss = (h / beta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; use 'sigmoid' or 'ipo'")
    return DPOTerms(
        loss=loss,
        chosen_rewards=(beta * chosen_ratio).detach(),
        rejected_rewards=(beta * rejected_ratio).detach(),
    )


@dataclass(frozen=True)
class DPOLoss:
    """Plain settings of the DPO loss (from the recipe's `dpo:` block).

    Attributes:
        beta: β > 0.
        label_smoothing: ε of conservative DPO.
        loss_type: 'sigmoid' or 'ipo'.
        ipo_token_mean: IPO on per-token mean logprobs (True) or sums (False).
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    ipo_token_mean: bool = True


def reply_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, token_mean: bool) -> torch.Tensor:
    """`[B]` per-row reply logprob: the masked sum of `[B, T]` logprobs, or its mean per
    token (an all-zero row gives 0)."""
    sums = (logprobs * mask).sum(-1)
    return sums / mask.sum(-1).clamp(min=1.0) if token_mean else sums


def loss(
    logprobs: torch.Tensor, mb: TrainBatch, cfg: DPOLoss, values: torch.Tensor | None = None
) -> LossOutput:
    """The DPO (or IPO) loss of one micro-batch of whole pairs.

    Args:
        logprobs: `[2p, T]` policy logprobs with gradients, chosen/rejected interleaved.
        mb: `response_mask [2p, T]`, `ref_sums [2p]` (the reference's summed reply
            logprobs) and `loss_denominator` (real pairs in the step); padding pairs
            have all-zero masks and count nowhere.
        values: unused.

    Raises:
        ValueError: `mb.ref_sums` is missing or the rows are not whole pairs.
    """
    if mb.ref_sums is None or len(mb) % 2:
        raise ValueError("the DPO loss needs ref_sums and whole (chosen, rejected) pairs")
    m = mb.response_mask
    mean = cfg.loss_type == "ipo" and cfg.ipo_token_mean
    pol = reply_logprobs(logprobs, m, mean)
    ref = mb.ref_sums / m.sum(-1).clamp(min=1.0) if mean else mb.ref_sums
    t = dpo_loss(
        pol[0::2], pol[1::2], ref[0::2], ref[1::2], cfg.beta, cfg.label_smoothing, cfg.loss_type
    )
    valid = (m[0::2].sum(-1) > 0).float()
    total = (t.loss * valid).sum() / mb.loss_denominator
    won = (t.chosen_rewards > t.rejected_rewards).float()
    return LossOutput(
        total,
        {
            "loss": float(total.detach()),
            "won": float((won * valid).sum()),
            "chosen": float((t.chosen_rewards * valid).sum()),
            "rejected": float((t.rejected_rewards * valid).sum()),
            "pairs": float(valid.sum()),
        },
    )


def finish_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Step metrics: loss and the implicit rewards' accuracy, means and margin per pair."""
    chosen, rejected = ratio_of(sums, "chosen", "pairs"), ratio_of(sums, "rejected", "pairs")
    return {
        "loss": sums.get("loss", 0.0),
        "rewards/accuracy": ratio_of(sums, "won", "pairs"),
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margin": chosen - rejected,
    }
