"""PPO's math as pure tensor functions: per-token rewards with a KL penalty, GAE,
masked whitening, the clipped value loss and explained variance. Shapes are `[B, T]`
with `mask [B, T]` = 1 on response tokens (the loss and GAE see nothing else).

Value convention: `values[:, t]` estimates the return from response token t on, read
from the critic at the position that predicts token t (as for logprobs).
"""

from __future__ import annotations

import torch


def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards: the sequence score on its last response token, minus a k1 KL
    penalty kl_coef·(logprobs − ref_logprobs) on every response token (Ziegler et al.
    2019; Ouyang et al. 2022, eq. 2).

    Args:
        scores: `[B]` sequence rewards.
        mask: `[B, T]` response mask (each row's ones are contiguous).

    Returns:
        `[B, T]` float32 rewards, 0 off the mask.
    """
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    if logprobs is not None and ref_logprobs is not None and kl_coef:
        rewards -= kl_coef * (logprobs - ref_logprobs) * mask
    cols = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, cols, torch.full_like(cols, -1)).max(-1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores[rows].float()
    return rewards


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al. 2016,
    eq. 16): δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}, returns = A + V.

    After a row's last response token the next value is `bootstrap[b]` (0 after EOS;
    the critic's estimate to bootstrap a truncated response), so padding after the
    response changes nothing.

    Args:
        rewards, values, mask: `[B, T]`.
        bootstrap: `[B]` value after the last token, default 0.

    Returns:
        advantages and returns, `[B, T]` float32, 0 off the mask.
    """
    b, t = mask.shape
    boot = torch.zeros(b) if bootstrap is None else bootstrap.float()
    adv = torch.zeros(b, t)
    next_value, next_adv = boot.clone(), torch.zeros(b)
    m, v, r = mask.float(), values.float(), rewards.float()
    for i in range(t - 1, -1, -1):
        delta = r[:, i] + gamma * next_value - v[:, i]
        a = delta + gamma * lam * next_adv
        # Off the mask, carry the tail state through unchanged (padding is invisible).
        adv[:, i] = a * m[:, i]
        next_value = torch.where(m[:, i] > 0, v[:, i], next_value)
        next_adv = torch.where(m[:, i] > 0, a, next_adv)
    return adv, (adv + v) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / std over the masked entries only; 0 off the mask."""
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * m


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ½·max((V − R)², (clip(V, V_old ± clip) − R)²) (PPO2 value clipping)
    and a `[B, T]` float mask of where the clipped branch was taken."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    a, b = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(a, b), (b > a).float()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over masked tokens (1: perfect critic, ≤0: useless)."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    var = r.var(unbiased=False)
    return float("nan") if var == 0 else float(1 - (r - v).var(unbiased=False) / var)
