"""DPO's loss as a pure tensor function (Rafailov et al. 2023), with IPO as an option
(Azar et al. 2023). Inputs are summed response logprobs per sequence, `[P]` for P
preference pairs; no model or config in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


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
    return DPOTerms(loss=loss, chosen_rewards=(beta * chosen_ratio).detach(),
                    rejected_rewards=(beta * rejected_ratio).detach())
