"""GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages and the clipped
policy loss with an optional k3 KL term. Pure tensor functions.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


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
