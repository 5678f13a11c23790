"""What a learner rank hands to `weightsync.publish` for one weight push, and the full
state dict that checkpoints reuse. Every function here is a collective over the FSDP
group: all ranks call it; rank 0 ends up with the tensors.

Four sources:
- plain policy: the state dict without tied aliases, each shard cast to the engines'
  dtype *before* its all-gather (half the bytes in bf16), one parameter at a time,
  with a layout known before gathering (so a transport may stream it); with a
  `ShmGather` (CPU ranks on one machine, `weight_sync.shm_gather`) the shards reach
  rank 0 through shared memory instead of all-gathers (learner/shm_gather.py);
- policy with an adapter, merged: the adapter merged into the (dequantised) base on
  a rank-0 copy, plain transformers names;
- adapter only: the PEFT adapter tensors with its LoraConfig in the handle's meta;
- the base of adapter-only sync (its full push at start, resume and engine
  replacement): the (dequantised) base *without* the adapter, which the engine then
  applies once. Its `expected` fingerprints, taken from the live modules' base weights
  by name rather than from the pushed tensors, are what the proof of delivery holds the
  engine's base to (weightsync/verify.py): a base pushed with the adapter merged in
  fails it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

from ..weightsync import PushSource, fingerprint
from . import adapters
from .adapters import AdapterSettings
from .shm_gather import ShmGather


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (plain tensors) without the later names of tensors that share storage."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def untied_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's state dict without tied aliases; the same names on every rank
    (`named_parameters` drops a shared Parameter's later names)."""
    keep = {n for n, _ in policy.named_parameters()}
    keep |= {n for n, _ in policy.named_buffers()}
    return {n: t for n, t in policy.state_dict().items() if n in keep}


def full_state_dict(
    policy: torch.nn.Module, rank: int, model_path: str, adapter: AdapterSettings, head: str = "lm"
) -> dict[str, torch.Tensor]:
    """The full policy under plain transformers names, float32 on CPU; with an adapter,
    merged into the (dequantised) base (`head`: 'lm' or 'score', the policy's head).
    Complete on rank 0, empty elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if adapter.enabled:
        full = adapters.gather_params(policy, adapter_only=False, keep=rank == 0)
        if rank != 0:
            return {}
        return adapters.merged_state_dict(full, model_path, adapter, head)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(policy, options=opts)


def _plain_stream(
    policy: torch.nn.Module, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor whole, cast to `dtype`: gathered from its DTensor shards, except on a
    one-rank mesh, where the local shard is the whole tensor (a DTensor cast and a
    one-rank all-gather per tensor took 0.3 s a push of the 135M model)."""
    for name, t in untied_state(policy).items():
        t = t.detach()
        if not hasattr(t, "full_tensor"):
            yield name, t.to(dtype)
        elif t.device_mesh.size() == 1:  # a copy even in the same dtype: a transport
            yield name, t.to_local().to(dtype, copy=True)  # may keep what it is given
        else:
            yield name, t.to(dtype).full_tensor()


def _later(make: callable) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterate `make()`'s dict only when the stream is consumed (the gather is a
    collective: it runs inside `publish`, inside the push's span)."""
    yield from make().items()


PushKind = Literal["merged", "adapter", "base"]


def push_kind(adapter_sync: bool, full: bool) -> PushKind:
    """What a push of a policy with an adapter carries: with adapter-only sync the
    adapter, or for a `full` push the base the engines apply it to; else merged weights."""
    if not adapter_sync:
        return "merged"
    return "base" if full else "adapter"


def push_source(
    policy: torch.nn.Module,
    rank: int,
    model_path: str,
    adapter: AdapterSettings,
    dtype: torch.dtype,
    kind: PushKind,
    gather: ShmGather | None = None,
) -> PushSource:
    """The tensors of one push, cast to the engines' `dtype`, as a `PushSource`.

    Plain policy: streamable (layout given; `kind` is ignored). With an adapter, by
    `kind`: 'merged' full weights; 'adapter' the adapter alone (PEFT names, e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` `[r, in]`) and
    `meta["adapter_config"]`, the `peft.LoraConfig` as a plain dict; 'base' the frozen
    base without the adapter (plain names), with `expected` the fingerprints of the
    learner's own base weights (filled on rank 0 as the tensors are produced). `gather`:
    a plain policy's shards go to rank 0 through shared memory (its dtype is `dtype`).
    """
    if not adapter.enabled:
        d = str(dtype).removeprefix("torch.")
        state = untied_state(policy)
        layout = [(n, d, tuple(t.shape)) for n, t in state.items()]
        if gather is not None:
            return PushSource(gather.stream(state), layout)
        return PushSource(_plain_stream(policy, dtype), layout)
    if kind == "base":
        return _base_source(policy, rank, model_path, adapter, dtype)
    if kind == "adapter":

        def state() -> dict[str, torch.Tensor]:
            full = adapters.gather_params(policy, adapter_only=True, keep=rank == 0)
            if rank != 0:
                return {}
            return {k: v.to(dtype) for k, v in adapters.peft_adapter_state(policy, full).items()}

        meta = {"adapter_config": adapters.config_dict(policy)} if rank == 0 else {}
        return PushSource(_later(state), None, meta)

    def merged() -> dict[str, torch.Tensor]:
        full = untied(full_state_dict(policy, rank, model_path, adapter))
        return {k: v.to(dtype) for k, v in full.items()}

    return PushSource(_later(merged), None)


def _base_source(
    policy: torch.nn.Module,
    rank: int,
    model_path: str,
    adapter: AdapterSettings,
    dtype: torch.dtype,
) -> PushSource:
    """The base push of adapter-only sync (see `push_source`)."""
    expected: dict[str, str] = {}

    def base() -> dict[str, torch.Tensor]:
        full = adapters.gather_params(policy, adapter_only=False, keep=rank == 0)
        if rank != 0:
            return {}
        # The proof's side, by name from the live weights (not through the push's path).
        for name, t in full.items():
            plain = adapters.plain_base_name(name)
            if plain is not None:
                expected[plain] = fingerprint(t.to(dtype))
        state = untied(adapters.base_state_dict(full, model_path, adapter))
        return {k: v.to(dtype) for k, v in state.items()}

    return PushSource(_later(base), None, expected=expected)
