"""A LoRA session's own state on one learner rank (learner/sessions.py): its regions of
the adapter slot, gradient buffers and AdamW, plus the per-session math that needs no
communication (Tinker's logprobs layout, the AdamW update, restoring a saved AdamW).

Everything here is local to the rank; the verbs that communicate are in sessions.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..algorithms.common import token_logprobs
from ..algorithms.tinker import SessionBatch, check_loss
from .logprobs import CHUNK_TOKENS, _head_returns_logprobs, _plain_head
from .session_slot import ATTN, MLP

ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


class UnknownSessionError(LookupError):
    """A verb named a session this learner has not open (the service's 404)."""


@dataclass
class Session:
    """One session's state on this rank; `params[i]` / `grads[i]` are its region of
    slot tensor i (None: a layer it does not train, or no gradient yet)."""

    sid: str
    rank: int
    targets: tuple[str, ...]
    params: list[torch.Tensor | None]
    grads: list[torch.Tensor | None]
    optimizer: torch.optim.AdamW | None = None
    step: int = 0  # AdamW updates applied (reset with the moments)
    pending: int = 0  # forward_backward calls waiting for an optim_step

    def trained(self) -> list[torch.Tensor]:
        return [p for p in self.params if p is not None]

    def memory(self) -> dict[str, int]:
        """Bytes of this rank's tensors of the session: adapter, gradients, AdamW."""

        def size(ts: list[torch.Tensor | None]) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        opt = 0
        if self.optimizer is not None:
            opt = sum(size(list(s.values())) for s in self.optimizer.state.values())
        return {
            "adapter_bytes": size(self.params),
            "grad_bytes": size(self.grads),
            "optimizer_bytes": opt,
        }


def session_targets(slot: tuple[str, ...], train_attn: bool, train_mlp: bool) -> tuple[str, ...]:
    """The slot's layers a session trains (a layer in neither group: always)."""
    off = (() if train_attn else ATTN) + (() if train_mlp else MLP)
    return tuple(m for m in slot if m not in off)


def adam_params(adam: dict) -> dict[str, float]:
    missing = [k for k in ADAM_KEYS if k not in adam]
    if missing:
        raise ValueError(f"session_optim_step: adam lacks {missing}; give all of {ADAM_KEYS}")
    out = {k: float(adam[k]) for k in ADAM_KEYS}
    bad = [k for k, v in out.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"session_optim_step: adam {bad[0]} is {out[bad[0]]}; must be finite")
    return out


def tinker_logprobs(model: torch.nn.Module, mb: SessionBatch) -> torch.Tensor:
    """`[B, T]` float32 log p(target_tokens[t] | input_ids[: t + 1]); the LM head runs
    in chunks (learner/logprobs.py) when it is a plain linear layer. A row with no real
    position (a rank's filler row) attends to its first token so its values stay finite
    whatever the attention kernel (transformers 5.19's sdpa and eager already keep a
    fully masked row finite; a kernel that gives NaN there would send NaN·0 = NaN
    gradients to the adapter); the caller's mask zeroes its loss."""
    mask = mb.attention_mask.long().clone()
    mask[mask.sum(-1) == 0, 0] = 1
    kwargs = dict(
        input_ids=mb.input_ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=False,
    )
    head = _plain_head(model)
    if head is None:
        return token_logprobs(model(**kwargs).logits, mb.target_tokens)
    b, t = mb.input_ids.shape
    dev = mb.input_ids.device
    rows = torch.arange(b, device=dev)[:, None].expand(b, t)
    cols = torch.arange(t, device=dev)[None].expand(b, t)
    with _head_returns_logprobs(head, mb.target_tokens, 1.0, CHUNK_TOKENS, (rows, cols)):
        return model(**kwargs).logits


def adamw_update(
    sess: Session, pairs: list[tuple[torch.Tensor, torch.Tensor]], hp: dict[str, float], norm: float
) -> None:
    """One AdamW update of `sess` (Loshchilov & Hutter 2019, decoupled weight decay; torch's
    `AdamW`) from `(param, grad)` pairs whose global grad norm is `norm` (finite), after
    scaling the gradients by min(1, clip / (norm + 1e-6)) when `grad_clip_norm` > 0 (as
    `torch.nn.utils.clip_grad_norm_`). The AdamW is created at the first update."""
    clip = hp["grad_clip_norm"]
    if clip > 0:
        coef = min(1.0, clip / (norm + 1e-6))
        for _, g in pairs:
            g.mul_(coef)
    if sess.optimizer is None:
        sess.optimizer = torch.optim.AdamW(sess.trained(), lr=hp["learning_rate"])
    for group in sess.optimizer.param_groups:
        group.update(
            lr=hp["learning_rate"],
            betas=(hp["beta1"], hp["beta2"]),
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
        )
    for p, g in pairs:
        p.grad = g
    sess.optimizer.step()
    for p in sess.trained():
        p.grad = None
    sess.step += 1


def restore_adamw(sess: Session, state: list[dict[str, torch.Tensor] | None], step: int) -> None:
    """Give `sess` an AdamW holding `state[i]` (`step`, `exp_avg`, `exp_avg_sq`, this
    rank's region) for each trained tensor `sess.params[i]`, and its step count."""
    sess.optimizer = torch.optim.AdamW(sess.trained())
    for p, st in zip(sess.params, state, strict=True):
        if p is not None and st is not None:
            sess.optimizer.state[p] = st
    sess.step = step


def check_items(
    items: list[tuple[str, SessionBatch, str, dict]], limit: int
) -> tuple[ValueError | None, list[dict]]:
    """This rank's verdict on a `sessions_forward_backward`'s items: (the error, or
    None; each item's loss config with defaults). At most `limit` items, each session
    once, each shard well formed and its loss served."""
    sids = [sid for sid, *_ in items]
    try:
        if not 1 <= len(items) <= limit:
            raise ValueError(
                f"sessions_forward_backward: {len(items)} sessions; 1 to "
                f"sessions.batch_sessions ({limit}) fit one forward"
            )
        if len(set(sids)) != len(sids):
            raise ValueError(f"sessions_forward_backward: a session twice in {sids}")
        configs = []
        for _, shard, loss_fn, loss_config in items:
            shard.check()
            configs.append(check_loss(loss_fn, loss_config, {"target_tokens", *shard.inputs}))
    except ValueError as e:  # every rank must learn of it, or the others would hang
        return e, []
    return None, configs
