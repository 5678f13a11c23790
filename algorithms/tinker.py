"""The losses of the Tinker API's `forward_backward`, by the names the Tinker SDK sends,
over its datum layout, and the batch a learner rank trains a session on.

Layout (Tinker's): per datum, `[N]` arrays `target_tokens` (int64), `weights`,
`logprobs` (the sampler's) and `advantages` (float32); position t scores
`target_tokens[t]` after `model_input[: t + 1]`. A padded batch of data is a
`SessionBatch` (`[B, T]`, right padding, `attention_mask` 0 on padding).

Every loss is a sum over tokens (Tinker's convention: the caller chooses the
normalisation through `weights` or `advantages`), built on posttrain's own loss terms
in `algorithms/`:

- `cross_entropy`: −Σ weights_t · logp_t.
- `importance_sampling`: −Σ r_t · A_t, r_t = exp(logp_t − logprobs_t) (REINFORCE with
  an off-policy correction; the ratio is not clipped).
- `ppo`: Σ of `common.clipped_policy_loss` (PPO, Schulman et al. 2017, eq. 7) with the
  ratio clipped to [clip_low_threshold, clip_high_threshold] (default 0.8, 1.2).
- `cispo`: Σ of `policy_losses.cispo` (MiniMax-M1 2025, eqs. 4-5), same thresholds.
- `gspo`: Σ over sequences of `policy_losses.gspo` (Zheng et al. 2025): one clipped
  sequence ratio per datum, the geometric mean of the token ratios over
  `sequence_ratio_mask` (default: the positions with a nonzero advantage, i.e. the
  sampled tokens), thresholds default 1 − 3e-4 / 1 + 4e-4 (GSPO's paper values).

Not served: `dro`, `stable_reinforce` (the cookbook's default; its server-side
stability records have no public definition) and `custom`: `check_loss` refuses them.
Errors are `LossSpecError(field, message)`, a ValueError naming the wire field to fix
(`loss_fn`, `loss_fn_config.<key>`, `loss_fn_inputs.<name>`); the service turns it into
its 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .common import clipped_policy_loss
from .policy_losses import cispo, gspo

# name → (required inputs, config keys with their defaults)
RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "cross_entropy": (("target_tokens",), {}),
    "importance_sampling": (RL_INPUTS, {}),
    "ppo": (RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "gspo": (RL_INPUTS, {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}),
}
OPTIONAL_INPUTS = {"weights", "sequence_ratio_mask"}  # the second: gspo's only


class LossSpecError(ValueError):
    """A loss request that can never succeed as sent; `field` names the wire field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


def check_loss(name: str, config: dict[str, float], input_names: set[str]) -> dict[str, float]:
    """Validate a loss name, its config and its datum's input names; return the config
    with defaults filled.

    Raises:
        LossSpecError: an unknown loss, config key or input, a missing input, or a
            non-finite config value (the field says which).
    """
    if name not in LOSSES:
        raise LossSpecError(
            "loss_fn", f"{name!r} is not served; choose one of {', '.join(sorted(LOSSES))}"
        )
    needed, defaults = LOSSES[name]
    unknown = set(config) - set(defaults)
    if unknown:
        raise LossSpecError(
            f"loss_fn_config.{sorted(unknown)[0]}",
            f"{name} takes {sorted(defaults) or 'no config'}",
        )
    missing = [k for k in needed if k not in input_names]
    if missing:
        raise LossSpecError(f"loss_fn_inputs.{missing[0]}", f"{name} needs {list(needed)}")
    optional = OPTIONAL_INPUTS if name == "gspo" else OPTIONAL_INPUTS - {"sequence_ratio_mask"}
    extra = input_names - set(needed) - optional
    if extra:
        raise LossSpecError(f"loss_fn_inputs.{sorted(extra)[0]}", f"{name} takes {list(needed)}")
    full = {**defaults, **config}
    for k, v in full.items():
        if not torch.isfinite(torch.tensor(v)):
            raise LossSpecError(f"loss_fn_config.{k}", f"must be finite, got {v}")
    return full


@dataclass
class LossResult:
    """`loss`: the scalar to backpropagate; `elementwise`: `[B, T]` per-token terms
    (zero on padding, no gradient); `metrics`: per-batch sums (`loss:sum`) that add
    across chunks and ranks."""

    loss: torch.Tensor
    elementwise: torch.Tensor
    metrics: dict[str, float]


def tinker_loss(
    name: str,
    logprobs: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    config: dict[str, float],
) -> LossResult:
    """One of `LOSSES` over a padded batch, summed over tokens (module docstring).

    Args:
        name: a key of `LOSSES` (checked by `check_loss`).
        logprobs: `[B, T]` the policy's logprobs of `target_tokens` (carry gradients).
        inputs: `[B, T]` float tensors by input name (padding zero).
        mask: `[B, T]` 1.0 on each datum's real positions.
        config: the loss's config with defaults (`check_loss`).
    """
    if name == "cross_entropy":
        w = inputs.get("weights", torch.ones_like(logprobs)) * mask
        per = -w * logprobs
        return LossResult(per.sum(), per.detach(), {"loss:sum": float(per.detach().sum())})
    old, adv = inputs["logprobs"], inputs["advantages"]
    if name == "importance_sampling":
        ratio = torch.exp((logprobs - old).clamp(-20.0, 20.0))
        per = -ratio * adv * mask
    elif name == "ppo":
        lo, hi = 1.0 - config["clip_low_threshold"], config["clip_high_threshold"] - 1.0
        per = clipped_policy_loss(logprobs, old, adv, lo, hi).loss * mask
    elif name == "cispo":
        lo, hi = 1.0 - config["clip_low_threshold"], config["clip_high_threshold"] - 1.0
        per = cispo(logprobs, old, adv, mask, lo, hi).loss * mask
    else:  # gspo: one loss per sequence, spread evenly over its ratio's tokens
        lo, hi = 1.0 - config["clip_low_threshold"], config["clip_high_threshold"] - 1.0
        ratio_mask = inputs.get("sequence_ratio_mask", (adv != 0).float()) * mask
        seq = gspo(logprobs, old, adv, ratio_mask, lo, hi).loss * ratio_mask
        per = seq / ratio_mask.sum(-1, keepdim=True).clamp(min=1.0)
    return LossResult(per.sum(), per.detach(), {"loss:sum": float(per.detach().sum())})


@dataclass
class SessionBatch:
    """One rank's rows of a session's `forward_backward` (service → learner), plain
    tensors in Tinker's layout (module docstring), right-padded.

    Attributes:
        input_ids: `[B, T]` int64, the datums' `model_input` tokens.
        attention_mask: `[B, T]` 1 on real positions, 0 on padding.
        target_tokens: `[B, T]` int64; position t scores `target_tokens[t]` after
            `input_ids[:, : t + 1]`.
        inputs: the loss's other inputs by name (`weights`, `logprobs`, `advantages`,
            `sequence_ratio_mask`), each `[B, T]` float32, zero on padding.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_tokens: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def check(self) -> None:
        """Raises ValueError naming the tensor when shapes or dtypes disagree or a
        float input is not finite (a service bug: the wire checks ran before)."""
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2 or shape[0] == 0:
            raise ValueError(f"SessionBatch.input_ids: shape {list(shape)}, want [B ≥ 1, T]")
        named = {"attention_mask": self.attention_mask, "target_tokens": self.target_tokens}
        named.update({f"inputs.{k}": v for k, v in self.inputs.items()})
        for name, t in named.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"SessionBatch.{name}: shape {list(t.shape)} != {list(shape)}")
        for name, t in self.inputs.items():
            if not torch.isfinite(t).all():
                raise ValueError(f"SessionBatch.inputs.{name}: holds NaN or inf")
        for name, t in (("input_ids", self.input_ids), ("target_tokens", self.target_tokens)):
            if t.dtype != torch.long:
                raise ValueError(f"SessionBatch.{name}: dtype {t.dtype}, want torch.int64")

    def to(self, device: torch.device) -> SessionBatch:
        return SessionBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.target_tokens.to(device),
            {k: v.to(device) for k, v in self.inputs.items()},
        )


def stack_batches(
    batches: list[SessionBatch], rows: int = 0, names: tuple[str, ...] = ()
) -> SessionBatch:
    """The rows of `batches`, in order, as one right-padded batch `[max(ΣB, rows),
    max T]` (the service: a rank's shard of a request's data; the learner: several
    sessions' shards in one forward). Its inputs: `names` and every input a batch has,
    zero where a batch lacks it. Rows past ΣB are filler rows: attention on their first
    position only (an all-masked row gives NaN attention) and every loss input zero
    (`names` must hold the loss's inputs when `batches` may be empty), so they add
    nothing to any loss or gradient."""
    total = sum(len(b) for b in batches)
    n = max(total, rows)
    width = max((b.input_ids.shape[1] for b in batches), default=1)
    names = sorted({k for b in batches for k in b.inputs} | set(names))
    out = SessionBatch(
        torch.zeros(n, width, dtype=torch.long),
        torch.zeros(n, width),
        torch.zeros(n, width, dtype=torch.long),
        {k: torch.zeros(n, width) for k in names},
    )
    start = 0
    for b in batches:
        here, t = b.input_ids.shape
        block = slice(start, start + here)
        out.input_ids[block, :t] = b.input_ids
        out.attention_mask[block, :t] = b.attention_mask
        out.target_tokens[block, :t] = b.target_tokens
        for k, v in b.inputs.items():
            out.inputs[k][block, :t] = v
        start += here
    out.attention_mask[total:, 0] = 1.0
    return out
