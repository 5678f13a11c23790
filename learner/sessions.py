"""Many LoRA sessions on one base model (`posttrain serve`): the learner verbs that open,
train, save, load, publish and close a session (`SessionVerbs`, a mixin of
`LearnerWorker`, used when `LearnerSettings.sessions` is set).

Structure: `setup` loads the policy once, sharded by FSDP2 as a recipe's is, with one
LoRA adapter slot of `sessions.batch_sessions` blocks of `sessions.max_rank` ranks
(learner/session_slot.py; no reference, critic or recipe optimizer). Each session is
THIS rank's part of its adapter tensors, its gradient buffers and its own AdamW (created
at its first `session_optim_step`), all plain local tensors at the session's true rank.
A verb writes its sessions into slot blocks (zeros elsewhere), runs, and takes each
block's gradients into its session's buffers, so sessions never mix: another session's
`session_forward_backward` between two of this one's does not touch its gradients, and
each session's result is bit for bit what it would be alone. `sessions_forward_backward`
runs several sessions in one forward (each row masked to its session's block), equal to
each alone to float32 rounding.

Losses: `algorithms.tinker` (Tinker's, summed over tokens); the gradient of the loss
summed over every rank's rows accumulates until `session_optim_step`.

Concurrency: every verb is collective: all ranks call it at once, in the same order,
with the same session and flags (a `backward` that differs between ranks raises
ValueError on every rank). `session_forward_backward` takes at least one row per rank;
ranks may hold different numbers of rows and columns. A rank with no datum gets a
filler row (attention_mask all 0): its loss and gradient are exactly 0.

Limits: one forward per call (no micro-batches: the caller sizes the shards); LoRA only
(no full fine-tuning session); `save_session` folders must be visible to every rank.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ..algorithms.tinker import SessionBatch, stack_batches, tinker_loss
from ..weightsync import Delivery, PushSource, WeightHandle, publish
from . import adapters, session_files
from . import session_slot as slots_
from .adapters import AdapterSettings
from .distributed import cuda_memory
from .models import DTYPES, load_sharded
from .session_slot import SlotParam
from .session_state import (
    Session,
    UnknownSessionError,
    adam_params,
    adamw_update,
    check_items,
    restore_adamw,
    session_targets,
    tinker_logprobs,
)

__all__ = ["SessionVerbs", "UnknownSessionError"]


class SessionVerbs:
    """The session verbs of `LearnerWorker` (module docstring). Uses the worker's `s`,
    `rank`, `world`, `device`, `spans` and `transport`."""

    def _setup_sessions(self) -> dict[str, int]:
        """Load the policy with the session slot (collective); the memory report."""
        s, ss = self.s, self.s.sessions
        if min(ss.max_rank, ss.max_sessions, ss.batch_sessions) < 1:
            raise ValueError(
                f"sessions: max_rank {ss.max_rank}, max_sessions {ss.max_sessions}, "
                f"batch_sessions {ss.batch_sessions}; each must be ≥ 1"
            )
        adapters.check_targets(s.model_path, ss.target_modules)
        ranks = ss.max_rank * ss.batch_sessions  # K blocks of R (learner/session_slot.py)
        slot = AdapterSettings(
            type="lora", r=ranks, alpha=float(ranks), target_modules=ss.target_modules
        )
        self.policy = load_sharded(
            s.model_path,
            self.world,
            s.compute_dtype,
            "policy",
            slot,
            checkpointing=s.gradient_checkpointing,
            device_type=self.device.type,
            compile_layers=s.compile,
            lora_a_columns=True,
        )
        self.slots: list[SlotParam] = slots_.slot_params(
            self.policy, self.rank, self.world, ss.max_rank
        )
        self.sessions: dict[str, Session] = {}
        return {**adapters.memory_report(self.policy, None), **cuda_memory(self.device)}

    def _session(self, sid: str) -> Session:
        if sid not in self.sessions:
            raise UnknownSessionError(
                f"session {sid!r} is not open on this learner (open: {sorted(self.sessions)})"
            )
        return self.sessions[sid]

    def open_session(
        self, sid: str, rank: int, seed: int, train_attn: bool = True, train_mlp: bool = True
    ) -> dict[str, int]:
        """A fresh session: peft's initial adapter (A kaiming-uniform drawn from `seed`,
        B zeros) at LoRA rank `rank`; AdamW comes at its first optim step. Returns
        `Session.memory()` (this rank's bytes). Collective only in agreement: no
        communication.

        Raises:
            ValueError: `sid` already open, `sessions.max_sessions` reached, `rank`
                outside [1, sessions.max_rank], or no layer left to train.
        """
        ss = self.s.sessions
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open on this learner")
        if len(self.sessions) >= ss.max_sessions:
            raise ValueError(
                f"session {sid!r}: {len(self.sessions)} sessions open, sessions.max_sessions "
                f"is {ss.max_sessions}; close one or raise sessions.max_sessions"
            )
        if not 1 <= rank <= ss.max_rank:
            raise ValueError(
                f"session {sid!r}: LoRA rank {rank} outside [1, sessions.max_rank "
                f"{ss.max_rank}]; raise sessions.max_rank"
            )
        targets = session_targets(ss.target_modules, train_attn, train_mlp)
        if not targets:
            raise ValueError(f"session {sid!r}: train_attn and train_mlp are both off")
        gen = torch.Generator().manual_seed(seed)
        params = [
            slots_.init_region(sl, rank, gen) if sl.module in targets else None for sl in self.slots
        ]
        sess = Session(sid, rank, targets, params, [None] * len(params))
        self.sessions[sid] = sess
        return sess.memory()

    def close_session(self, sid: str) -> None:
        """Drop a session and its tensors (no communication)."""
        self.sessions.pop(sid, None)

    def session_memory(self, sid: str) -> dict[str, int]:
        """This rank's bytes of the session (`Session.memory`)."""
        return self._session(sid).memory()

    def list_sessions(self) -> dict[str, dict]:
        """Every open session: `rank`, `targets`, `step` (AdamW updates), `pending`
        (forward_backward calls waiting for an optim step) and this rank's bytes (for a
        status route; no communication)."""
        return {
            sid: {
                "rank": s.rank,
                "targets": list(s.targets),
                "step": s.step,
                "pending": s.pending,
                **s.memory(),
            }
            for sid, s in self.sessions.items()
        }

    def _agree(self, verb: str, refused: ValueError | None, values: list[int]) -> None:
        """One all-reduce: raise on every rank when any rank `refused` its input (that
        error where it happened) or `values` differ between ranks."""
        n = len(values)
        flags = [*values, *(-v for v in values), int(refused is not None)]
        t = torch.tensor(flags, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if refused is not None:
            raise refused
        if t[-1] > 0:
            raise ValueError(f"{verb}: another learner rank refused its shard (see its error)")
        if (t[:n] != -t[n : 2 * n]).any():
            raise ValueError(f"{verb}: ranks disagree on {values}; call every rank alike")

    def session_forward_backward(
        self, sid: str, shard: SessionBatch, loss_fn: str, loss_config: dict, backward: bool
    ) -> dict:
        """Logprobs and Tinker's loss `loss_fn` on this rank's rows under session `sid`;
        with `backward`, the gradient of the loss summed over every rank's rows adds to
        the session's buffers. Collective. `sessions_forward_backward` with one item.

        Returns:
            `logprobs` `[B, T]` float32 (0 off the mask), `elementwise_loss` `[B, T]`,
            `metrics` (`loss:sum` over this rank's rows), on CPU.

        Raises:
            UnknownSessionError; LossSpecError (a ValueError) for the loss; ValueError
            for a malformed shard or a `backward` that differs between ranks.
        """
        return self.sessions_forward_backward([(sid, shard, loss_fn, loss_config)], backward)[0]

    def sessions_forward_backward(
        self, items: list[tuple[str, SessionBatch, str, dict]], backward: bool
    ) -> list[dict]:
        """`session_forward_backward` of up to `sessions.batch_sessions` different
        sessions in ONE forward (and backward): item k = (sid, this rank's shard,
        loss_fn, loss_config) runs in slot block k (`session_slot.block_lora`), so each
        session's rows see only its adapter and its gradients go only to its buffers.
        Returns one result per item, as `session_forward_backward`'s. Collective: every
        rank passes the same sessions in the same order.

        Raises:
            as `session_forward_backward`; ValueError: more items than
            `sessions.batch_sessions`, or a session twice.
        """
        sessions = [self._session(sid) for sid, *_ in items]
        refused, configs = check_items(items, self.s.sessions.batch_sessions)
        self._agree("sessions_forward_backward", refused, [int(backward), len(items)])
        slots_.load_into_slot(self.slots, [(s.params, s.rank) for s in sessions])
        for sl in self.slots:  # a call that failed midway must not leak its gradients
            sl.param.grad = None
        shards = [shard for _, shard, *_ in items]
        mb = stack_batches(shards).to(self.device)
        mask = mb.attention_mask.float()
        self.policy.train(backward)
        step = sessions[0].step
        rows = [(len(shard), sess.rank) for shard, sess in zip(shards, sessions, strict=True)]
        with slots_.block_lora(self.policy, self.slots, rows), torch.set_grad_enabled(backward):
            with self.spans.span("forward", step):
                logprobs = tinker_logprobs(self.policy, mb) * mask
                outs, start = [], 0
                for (_, shard, loss_fn, _), config in zip(items, configs, strict=True):
                    rows, width = slice(start, start + len(shard)), shard.input_ids.shape[1]
                    inputs = {k: mb.inputs[k][rows, :width] for k in shard.inputs}
                    lp, m = logprobs[rows, :width], mask[rows, :width]
                    outs.append((lp, tinker_loss(loss_fn, lp, inputs, m, config)))
                    start += len(shard)
            if backward:
                with self.spans.span("backward", step):
                    total = sum(out.loss for _, out in outs)
                    (total * self.world).backward()  # FSDP2 averages over ranks: sum them
                for k, sess in enumerate(sessions):
                    self._take_grads(sess, k)
                for sl in self.slots:
                    sl.param.grad = None
        self.policy.reshard()  # the root stays unsharded after a forward
        return [
            {
                "logprobs": lp.detach().cpu(),
                "elementwise_loss": out.elementwise.cpu(),
                "metrics": out.metrics,
            }
            for lp, out in outs
        ]

    def _take_grads(self, sess: Session, block: int) -> None:
        """Move the slot's gradients of `block` (this rank's shard) into the session's
        buffers; the caller clears the slot's gradients after the last block."""
        for i, sl in enumerate(self.slots):
            g = sl.param.grad
            if g is None or sess.params[i] is None:
                continue
            local = g.to_local() if hasattr(g, "to_local") else g
            part = local[sl.region(sess.rank, block)].float()
            have = sess.grads[i]
            sess.grads[i] = part.clone() if have is None else have.add_(part)
        sess.pending += 1

    def session_optim_step(self, sid: str, adam: dict) -> dict[str, float | int | bool]:
        """AdamW (decoupled weight decay) on the session's accumulated gradients, then
        clear them. `adam`: `learning_rate`, `beta1`, `beta2`, `eps`, `weight_decay`,
        `grad_clip_norm` (0: no clipping; else scale by min(1, clip / (norm + 1e-6)) as
        `torch.nn.utils.clip_grad_norm_`). A non-finite grad norm skips the update.
        Collective (the norm is global).

        Returns:
            `grad_norm` (global, before clipping), `step` (AdamW updates applied to
            this session), `skipped` (True: not applied).
        """
        sess = self._session(sid)
        hp = adam_params(adam)
        pairs = [(p, g) for p, g in zip(sess.params, sess.grads, strict=True) if g is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for _, g in pairs:
            sq += g.double().pow(2).sum()
        dist.all_reduce(sq)
        norm = math.sqrt(sq.item())
        applied = math.isfinite(norm)
        with self.spans.span("optimizer", sess.step):
            if applied:
                adamw_update(sess, pairs, hp, norm)
        sess.grads = [None] * len(sess.grads)
        sess.pending = 0
        return {"grad_norm": norm, "step": sess.step, "skipped": not applied}

    # -- whole tensors: checksum, save, load, publish ---------------------------------
    def _wholes(self, sess: Session, parts: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Whole rank-r tensors by PEFT name from per-slot regions (collective)."""
        return {
            sl.peft_name: slots_.full(sl, part, sess.rank)
            for sl, part, mine in zip(self.slots, parts, sess.params, strict=True)
            if mine is not None
        }

    def session_checksum(self, sid: str) -> str:
        """sha256 (hex) of the session's whole adapter tensors, float32, in slot order;
        equal on every rank. Collective."""
        h = hashlib.sha256()
        for t in self._wholes(self._session(sid), self._session(sid).params).values():
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    def _moments(self, sess: Session) -> dict[str, torch.Tensor]:
        """AdamW's state as whole tensors by `NAME.key` (collective)."""
        out: dict[str, torch.Tensor] = {}
        state = sess.optimizer.state if sess.optimizer is not None else {}
        for key in session_files.OPT_KEYS:
            parts = []
            for p in sess.params:
                if p is None:
                    parts.append(None)
                else:  # no state yet (no step taken): zeros, as AdamW would start
                    parts.append(state[p][key] if p in state else torch.zeros_like(p))
            out.update({f"{k}.{key}": v for k, v in self._wholes(sess, parts).items()})
        for sl, p in zip(self.slots, sess.params, strict=True):
            if p is not None:
                step = state[p]["step"] if p in state else torch.tensor(0.0)
                out[f"{sl.peft_name}.step"] = step.detach().cpu().float().reshape(())
        return out

    def save_session(self, sid: str, path: str, optimizer: bool) -> str | None:
        """Save the session into folder `path` (learner/session_files.py): adapter in
        PEFT format and, with `optimizer`, AdamW's moments and step. Collective; rank 0
        writes and returns `path`, the others None, once the folder is complete."""
        sess = self._session(sid)
        with self.spans.span("checkpoint", sess.step):
            adapter = self._wholes(sess, sess.params)
            opt = self._moments(sess) if optimizer else None
            if self.rank == 0:
                session_files.save(
                    Path(path),
                    adapter,
                    opt,
                    sess.rank,
                    sess.targets,
                    sess.step,
                    self.s.model_path,
                )
            dist.barrier()  # every rank may read the folder once this returns
        return path if self.rank == 0 else None

    def load_session(self, sid: str, path: str, optimizer: bool) -> dict[str, int]:
        """Replace session `sid`'s adapter by the one saved in `path` and clear its
        gradients; with `optimizer` its AdamW moments and step come too, without it
        AdamW starts afresh (moments zero, step 0). Returns {`step`}. Every rank reads.

        Raises:
            UnknownSessionError; FileNotFoundError: no saved session at `path`;
            ValueError: saved at another rank or for other layers, or without the
                optimizer state `optimizer` asks for.
        """
        sess = self._session(sid)
        folder = Path(path)
        saved = session_files.read(folder, optimizer)
        if (saved.rank, saved.targets) != (sess.rank, sess.targets):
            raise ValueError(
                f"{folder}: saved at rank {saved.rank} for {list(saved.targets)}; session "
                f"{sid!r} is rank {sess.rank} for {list(sess.targets)}"
            )
        params, state = session_files.parts(saved, self.slots, sess.params, sess.rank, folder)
        sess.params, sess.grads, sess.pending = params, [None] * len(params), 0
        sess.optimizer, sess.step = None, 0  # weights only: AdamW starts afresh
        if saved.optimizer is not None:
            restore_adamw(sess, state, saved.step)
        return {"step": sess.step}

    def publish_session(
        self, sid: str, version: int, name: str | None = None
    ) -> Iterator[WeightHandle | Delivery | None]:
        """Push the session's adapter as `version` through the weight transport, as
        `publish_weights` does (a generator: rank 0's handle, then with verification its
        `Delivery`): PEFT names at the session's true rank, cast to the compute dtype,
        `meta["adapter_config"]` (LoraConfig(r, alpha=r, its layers)) and
        `meta["adapter_name"]`: `name`, else `sid` (the service names each sampler's
        adapter, so older samplers stay servable). Collective."""
        sess = self._session(sid)
        dtype = DTYPES[self.s.compute_dtype]

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            wholes = self._wholes(sess, sess.params)  # gathered when the push runs
            if self.rank == 0:
                yield from ((k, v.to(dtype)) for k, v in wholes.items())

        meta = {}
        if self.rank == 0:
            cfg = session_files.config_dict(sess.rank, sess.targets, self.s.model_path)
            meta = {"adapter_config": cfg, "adapter_name": name or sid}
        with self.spans.span("weight_sync", sess.step):
            yield from publish(
                self.transport,
                PushSource(tensors(), None, meta),
                version,
                sender=self.rank == 0,
                verify=self.s.transport.checksum,
            )
