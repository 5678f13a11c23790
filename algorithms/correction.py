"""Off-policy correction between the policy that sampled (the rollout engine, whose
logprobs are `inference_logprobs`) and the policy the learner trains from
(`old_logprobs`), as pure tensor functions.

Why: the engine's sampling distribution differs from the learner's even at the same
weights (bf16 kernels, another implementation), and more so when a sample was made
by an older `policy_version` (asynchronous training, `train.max_staleness`). The
clipped ratio exp(logprobs − old_logprobs) does not see that gap; an importance weight

    w = π_old(y) / π_inference(y) = exp(old_logprobs − inference_logprobs)

does. Three ways to use it with bounded variance (`train.correction`):

- TIS, truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"): the policy loss of each token is
  multiplied by sg(min(w, C)).
- MIS, masked importance sampling (verl's rollout correction "rejection" mode; IcePop,
  Ling team 2025): tokens whose w lies outside [1/C, C] are left out of the loss
  (weight 0); the others keep weight 1. The step's loss denominator is unchanged, as
  in IcePop's objective, so a masked token counts as a zero-gradient token.
- Decoupled PPO (`mode: decoupled`; Fu et al. 2025, "AReaL: A Large-Scale
  Asynchronous Reinforcement Learning System for Language Reasoning", §5.2, eq. 5):
  three policies, π_behav that sampled each token (`inference_logprobs`), the proximal
  π_prox the trust region is drawn around (`old_logprobs`: the learner's policy at
  the step's start, from its no-grad pass, or with one update per step the update's
  own forward, detached) and π_θ being trained:

      J(θ) = E_{a_t ~ π_behav} [ Σ_t w_t · min( u_t·A_t, clip(u_t, 1 − ε_low, 1 + ε_high)·A_t ) ]
      w_t = π_prox(a_t) / π_behav(a_t) = exp(old_logprobs_t − inference_logprobs_t)
      u_t = π_θ(a_t) / π_prox(a_t)     = exp(logprobs_t − old_logprobs_t)

  w_t is a constant (no gradient), not truncated; a token whose w_t exceeds C leaves
  the loss (weight 0; AReaL's `behav_imp_weight_cap`, one-sided), so a token the
  behaviour policy found far likelier than the proximal one cannot dominate. The clip
  is the policy loss's own (`grpo.clip_*`, `ppo.clip_eps`), around π_prox, so how far
  one step moves the policy does not depend on how stale the sample is. Token level
  only: with partial rollouts (`rollout.partial`) one response holds tokens of several
  policy versions and `inference_logprobs[t]` is the logprob under the version that
  sampled token t (`policy_versions[t]`, actors/partial.py), so each token's behaviour
  policy is its own.

TIS at token level differs from decoupled PPO only in what it does with a large w:
TIS truncates it to C (the token still trains, at weight C), decoupled PPO drops the
token. MIS also drops w < 1/C.

`level: sequence` (TIS and MIS) uses one weight per response, w = exp(Σ_t (old −
inference)) over its response tokens (the product of token weights), broadcast to its
tokens; MIS then masks the whole response.

Shapes: B sequences, T token columns, `mask [B, T]` = 1 on the loss's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .common import kl_k3

Mode = Literal["none", "tis", "mis", "decoupled"]
Level = Literal["token", "sequence"]


@dataclass(frozen=True)
class Correction:
    """Plain settings of the correction (from the recipe's `train.correction`).

    Attributes:
        mode: 'none' (the loss is unchanged), 'tis', 'mis' or 'decoupled'.
        level: 'token' or 'sequence' ('decoupled': token only).
        cap: C > 1; TIS truncates at C, MIS keeps weights in [1/C, C], decoupled
            keeps weights ≤ C.
    """

    mode: Mode = "none"
    level: Level = "token"
    cap: float = 2.0


@dataclass
class CorrectionTerms:
    """What the loss multiplies and what the step reports, all `[B, T]` float32, detached.

    Attributes:
        factor: multiplies each token's policy loss (TIS: min(w, C); MIS: 1 kept, 0
            masked; decoupled: w kept, 0 masked; 0 off the mask).
        weight: the raw importance weight w of each token (its sequence's at sequence
            level), before truncation or masking.
        corrected: 1.0 where TIS truncated or MIS or decoupled masked.
    """

    factor: torch.Tensor
    weight: torch.Tensor
    corrected: torch.Tensor


def log_weights(
    old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor, level: Level
) -> torch.Tensor:
    """log w per token: `old − inference` (token level) or each row's sum of it over
    `mask`, broadcast to every column (sequence level). Clamped to ±20 so an outlier
    cannot overflow exp. `[B, T]` in, `[B, T]` out (0 off the mask at token level).

    Raises:
        ValueError: an unknown level.
    """
    d = (old_logprobs - inference_logprobs).detach().float() * mask
    if level == "token":
        return d.clamp(-20.0, 20.0)
    if level == "sequence":
        return d.sum(-1, keepdim=True).clamp(-20.0, 20.0).expand_as(d)
    raise ValueError(f"unknown correction level {level!r}; use token or sequence")


def tis_factor(weights: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(w, C) (Yao et al. 2025). Any shape."""
    return weights.clamp(max=cap)


def mis_mask(weights: torch.Tensor, cap: float) -> torch.Tensor:
    """1.0 where 1/C ≤ w ≤ C, else 0.0 (masked importance sampling). Any shape."""
    return ((weights >= 1.0 / cap) & (weights <= cap)).to(torch.float32)


def decoupled_factor(weights: torch.Tensor, cap: float) -> torch.Tensor:
    """Decoupled PPO's behaviour weight (AReaL, Fu et al. 2025, eq. 5, with its
    `behav_imp_weight_cap`): w where w ≤ C, else 0.0. Any shape."""
    return torch.where(weights <= cap, weights, torch.zeros_like(weights))


def correction_terms(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: Correction,
) -> CorrectionTerms:
    """The factor on each token's policy loss, the raw weights and where they acted.

    Args:
        old_logprobs: `[B, T]` the learner's logprobs of the policy trained from.
        inference_logprobs: `[B, T]` the engine's logprobs of the same tokens.
        mask: `[B, T]` response mask.
        cfg: mode 'tis', 'mis' or 'decoupled' (mode 'none' never calls this), level and
            cap.

    Raises:
        ValueError: mode 'none' or an unknown mode, cap ≤ 1, or 'decoupled' at
            sequence level.
    """
    if cfg.cap <= 1.0:
        raise ValueError(f"correction cap must be > 1, got {cfg.cap}")
    if cfg.mode == "decoupled" and cfg.level != "token":
        raise ValueError(
            "correction mode 'decoupled' weighs each token by its own behaviour policy; "
            f"level must be 'token', got {cfg.level!r}"
        )
    w = torch.exp(log_weights(old_logprobs, inference_logprobs, mask, cfg.level))
    if cfg.mode == "tis":
        factor = tis_factor(w, cfg.cap)
        corrected = (w > cfg.cap).to(torch.float32)
    elif cfg.mode == "mis":
        factor = mis_mask(w, cfg.cap)
        corrected = 1.0 - factor
    elif cfg.mode == "decoupled":
        factor = decoupled_factor(w, cfg.cap)
        corrected = (w > cfg.cap).to(torch.float32)
    else:
        raise ValueError(f"correction mode {cfg.mode!r} has no terms; use tis, mis or decoupled")
    return CorrectionTerms(factor=factor * mask, weight=w, corrected=corrected * mask)


def mismatch_sums(
    old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Numerators of the behaviour-vs-learner mismatch over `mask`:

    - `mismatch_k3`: Σ k3 estimate of KL(π_inference ‖ π_old) from the engine's own
      samples, r − 1 − log r with r = exp(old − inference) (Schulman 2020);
    - `mismatch_abs`: Σ |old − inference|.

    Divide by the token count for the step's means. `[B, T]` in.
    """
    old, inf = old_logprobs.detach().float(), inference_logprobs.detach().float()
    return {
        "mismatch_k3": float((kl_k3(inf, old) * mask).sum()),
        "mismatch_abs": float(((old - inf).abs() * mask).sum()),
    }


def apply_correction(
    policy_loss: torch.Tensor,
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: Correction,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The corrected per-token policy loss `factor · policy_loss` and the sums
    `is_weight` (Σ raw w), `is_corrected` (tokens truncated or masked), over `mask`.
    `[B, T]` in, `[B, T]` out. Raises as `correction_terms`."""
    t = correction_terms(old_logprobs, inference_logprobs, mask, cfg)
    return t.factor * policy_loss, {
        "is_weight": float((t.weight * mask).sum()),
        "is_corrected": float(t.corrected.sum()),
    }


def truncated_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """Logprobs of `targets` under the distribution an engine samples with top-k and
    top-p (nucleus, Holtzman et al. 2020): softmax(logits / T), keep the k most likely
    tokens, then the smallest set of most likely tokens whose mass reaches `top_p`, and
    renormalise over what is kept. A target outside the kept set gets -inf.

    Ties: tokens are ranked by a stable descending sort; the token that crosses `top_p`
    is kept (as vLLM and transformers do).

    Args:
        logits: `[..., V]` scores whose last position predicts `targets`.
        targets: `[...]` token ids.
        temperature: > 0.
        top_p: in (0, 1]; 1 keeps every token.
        top_k: 0 keeps every token, else the k most likely.

    Returns:
        `[...]` float32 logprobs.
    """
    scaled = logits.float() / temperature
    probs = scaled.softmax(-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep_sorted[..., top_k:] = False
        sorted_p = sorted_p * keep_sorted
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    if top_p < 1.0:
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above
        keep_sorted &= before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = scaled.masked_fill(~keep, float("-inf"))
    picked = kept.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(kept, dim=-1)


def correction_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Step metrics from the summed loss sums (each over `tokens`): `mismatch_kl_k3`,
    `mismatch_abs` (behaviour vs learner logprobs), and with a correction
    `is_weight_mean` and `is_corrected_fraction` (truncated or masked tokens)."""
    n = max(sums.get("tokens", 0.0), 1.0)
    out = {}
    if "mismatch_k3" in sums:
        out["mismatch_kl_k3"] = sums["mismatch_k3"] / n
        out["mismatch_abs"] = sums["mismatch_abs"] / n
    if "is_weight" in sums:
        out["is_weight_mean"] = sums["is_weight"] / n
        out["is_corrected_fraction"] = sums["is_corrected"] / n
    return out
