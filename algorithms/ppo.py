"""PPO's math as pure tensor functions: per-token rewards with a KL penalty, GAE,
masked whitening, the clipped value loss and explained variance. Shapes are `[B, T]`
with `mask [B, T]` = 1 on response tokens (the loss and GAE see nothing else).

Value convention: `values[:, t]` estimates the return from response token t on, read
from the critic at the position that predicts token t (as for logprobs): V(s_t), the
state before token t. The value after a row's last token, V(s_T), is read at the
position of that token; a truncated response bootstraps from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import TrainBatch
from .common import (
    LossOutput,
    aggregate_loss,
    clipped_policy_loss,
    masked_sum,
    ratio_of,
)
from .correction import (
    Correction,
    apply_correction,
    correction_metrics,
    mismatch_sums,
)
from .policy_losses import with_kl


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


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """`[B]` column of each row's last masked token (0 for an all-zero row)."""
    cols = torch.arange(mask.shape[1]).expand_as(mask)
    return torch.where(mask > 0, cols, torch.zeros_like(cols)).max(-1).values


def advantages_and_returns(
    batch: TrainBatch,
    scores: torch.Tensor,
    truncated: torch.Tensor,
    final_values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_coef: float = 0.0,
    whiten: bool = True,
    bootstrap_truncated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's advantage estimator: per-token rewards (score on the last token, minus
    kl_coef·k1 when `kl_coef` > 0), GAE(γ, λ) and optional whitening.

    A response cut at max_new_tokens (`truncated`) with `bootstrap_truncated`
    bootstraps from V(s_T), the critic's value after its last token (`final_values`);
    a response that ended with EOS bootstraps from 0.

    Args:
        batch: holds `response_mask`, `values` (V(s_t), `[B, T]`), `old_logprobs` and,
            with KL, `ref_logprobs`.
        scores: `[B]` sequence rewards.
        truncated: `[B]` bool, finish_reason == 'length'.
        final_values: `[B]` V(s_T) per row.

    Returns:
        raw advantages, (whitened) advantages and returns, all `[B, T]`.
    """
    m = batch.response_mask
    rewards = token_rewards(scores, m, batch.old_logprobs, batch.ref_logprobs, kl_coef)
    boot = final_values.float() * truncated.float() if bootstrap_truncated else None
    raw, returns = gae(rewards, batch.values, m, gamma, lam, boot)
    return raw, (masked_whiten(raw, m) if whiten else raw), returns


@dataclass(frozen=True)
class PPOLoss:
    """Plain settings of the PPO loss (from the recipe's `ppo:` block).

    Attributes:
        clip_eps: policy ratio clip ε (Schulman et al. 2017, eq. 7).
        kl_coef: weight of a k3 KL term in the loss (`kl_mode: loss`; 0 with
            `kl_mode: reward`, where the penalty is in the rewards).
        cliprange_value: value clip around the old values.
        correction: off-policy correction of the policy term against
            `inference_logprobs` (`algorithms.correction`); 'none' leaves it untouched.
    """

    clip_eps: float = 0.2
    kl_coef: float = 0.0
    cliprange_value: float = 0.2
    correction: Correction = Correction()


def loss(
    logprobs: torch.Tensor, mb: TrainBatch, cfg: PPOLoss, values: torch.Tensor | None = None
) -> LossOutput:
    """Clipped policy loss plus clipped value loss of one micro-batch (one backward:
    policy and critic have disjoint parameters).

    Args:
        logprobs: `[b, T]` policy logprobs with gradients.
        mb: `old_logprobs`, `advantages` (whitened), `returns`, `values` (the critic's
            before this update), `response_mask`, all `[b, T]`; `ref_logprobs` with KL.
        values: `[b, T]` the critic's current values, with gradients.

    Raises:
        ValueError: `values` or `mb.old_logprobs` is missing.
    """
    if values is None or mb.old_logprobs is None:
        raise ValueError("the PPO loss needs the critic's values and old_logprobs")
    m, extra = mb.response_mask, {}
    if cfg.correction.mode == "none":  # exactly the uncorrected path
        t = clipped_policy_loss(
            logprobs,
            mb.old_logprobs,
            mb.advantages,
            cfg.clip_eps,
            cfg.clip_eps,
            ref_logprobs=mb.ref_logprobs,
            kl_coef=cfg.kl_coef,
        )
        per_token = t.loss
    else:  # the weight multiplies the policy term only, not the KL to the reference
        t = clipped_policy_loss(
            logprobs, mb.old_logprobs, mb.advantages, cfg.clip_eps, cfg.clip_eps
        )
        policy, extra = apply_correction(
            t.loss, mb.old_logprobs, mb.inference_logprobs, m, cfg.correction
        )
        per_token, t.kl = with_kl(policy, logprobs, mb.ref_logprobs, cfg.kl_coef)
    if mb.inference_logprobs is not None:
        extra |= mismatch_sums(mb.old_logprobs, mb.inference_logprobs, m)
    pg = aggregate_loss(per_token, m, mb.loss_denominator)
    vl, vclip = clipped_value_loss(values, mb.values, mb.returns, cfg.cliprange_value)
    vf = aggregate_loss(vl, m, mb.loss_denominator)
    return LossOutput(
        pg + vf,
        {
            "loss": float(pg.detach()),
            "value_loss": float(vf.detach()),
            "clipped": masked_sum(t.clipped, m),
            "value_clipped": masked_sum(vclip, m),
            "kl": masked_sum(t.kl, m),
            "tokens": float(m.sum()),
            **extra,
        },
    )


def finish_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Step metrics of one PPO update from its summed loss sums."""
    return {
        "loss": sums.get("loss", 0.0),
        "value_loss": sums.get("value_loss", 0.0),
        "clip_fraction": ratio_of(sums, "clipped", "tokens"),
        "value_clip_fraction": ratio_of(sums, "value_clipped", "tokens"),
        "kl": ratio_of(sums, "kl", "tokens"),
        **correction_metrics(sums),
    }
