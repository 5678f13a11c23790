"""The LoRA adapter slot that every session of a learner rank trains through, and how a
session's tensors map onto this rank's shard of it.

The slot is a peft LoRA adapter of rank K·R (R = `sessions.max_rank`, K =
`sessions.batch_sessions`) with lora_alpha = K·R, so its scale is 1, as Tinker's alpha =
rank gives for every rank. It holds K blocks of R ranks; a session of rank r ≤ R placed
in block k uses rows [kR, kR + r) of each `lora_A [KR, in]` and the same columns of each
`lora_B [out, KR]`. Every pass computes the LoRA term per session (`block_lora`): each
session's rows run only its block's first r ranks, h = W0 x + B[:, blk] A[blk] x, the
rank-r adapter's output, so a row pays its session's rank, not K·R, several sessions in
one forward (K > 1) never meet in rows or gradients, and the rest of the slot is never
read (it keeps whatever an earlier pass left there). A session that trains only the
attention (or only the MLP) projections has zeros in its region of the others.

FSDP2 shards `lora_A` on its columns (dim 1) and `lora_B` on its rows (dim 0), in
`torch.chunk` pieces (rank j holds [j·c, min((j + 1)·c, n)), c = ⌈n / world⌉), so every
rank holds all K·R ranks of its part and a block sits on every rank alike. A session
keeps only its r ranks of this rank's part (`SlotParam.region`), the same whatever block
it runs in, so it costs its true rank on every rank. `full` and `local_part` move
between that part and the whole `[r, in]` / `[out, r]` tensor (`full` is a collective).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .adapters import ADAPTER

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class SlotParam:
    """One trainable tensor of the slot on this rank.

    Attributes:
        name: its live name (`...q_proj.lora_A.default.weight`).
        param: the FSDP2 parameter (a DTensor; A sharded on dim 1, B on dim 0).
        module: the targeted layer's short name (`q_proj`).
        is_a: True for `lora_A [KR, in]` (sharded on dim 1), False for
            `lora_B [out, KR]` (sharded on dim 0).
        offset: the global index, on the sharded dim, of this rank's first one.
        block: R, the ranks per block.
    """

    name: str
    param: torch.nn.Parameter
    module: str
    is_a: bool
    offset: int
    block: int

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard (a view FSDP2 all-gathers from)."""
        p = self.param
        return p.to_local() if hasattr(p, "to_local") else p

    @property
    def peft_name(self) -> str:
        """The name in a PEFT adapter file (`...q_proj.lora_A.weight`)."""
        return self.name.replace(f".{ADAPTER}.", ".")

    def region(self, r: int, k: int = 0) -> tuple[slice, slice]:
        """The part of the local shard a rank-`r` session in block `k` uses."""
        ranks = slice(k * self.block, k * self.block + r)
        return (ranks, slice(None)) if self.is_a else (slice(None), ranks)

    def full_shape(self, r: int) -> tuple[int, int]:
        """The whole tensor of a rank-`r` session: `[r, in]` (A) or `[out, r]` (B)."""
        out, inp = self.param.shape
        return (r, inp) if self.is_a else (out, r)


def slot_params(model: torch.nn.Module, rank: int, world: int, block: int) -> list[SlotParam]:
    """The slot's trainable tensors in `named_parameters` order (the same on every rank);
    `block`: R, ranks per block.

    Raises:
        RuntimeError: FSDP2 sharded a tensor otherwise than A on dim 1 and B on dim 0 in
            `torch.chunk` pieces (the region arithmetic would then be wrong).
    """
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        kind = parts[-3]  # ... q_proj . lora_A . default . weight
        if kind not in ("lora_A", "lora_B"):
            raise RuntimeError(f"session slot: unexpected trainable tensor {name}")
        dim = 1 if kind == "lora_A" else 0
        placements = getattr(p, "placements", None)
        if placements is not None and getattr(placements[0], "dim", dim) != dim:
            raise RuntimeError(f"session slot: {name} is sharded on {placements}, not dim {dim}")
        size = p.shape[dim]
        chunk = math.ceil(size / world)
        offset = min(rank * chunk, size)
        slot = SlotParam(name, p, parts[-4], kind == "lora_A", offset, block)
        if slot.local.shape[dim] != max(0, min(chunk, size - offset)):
            raise RuntimeError(f"session slot: {name} is not sharded in torch.chunk pieces")
        out.append(slot)
    return out


def init_region(slot: SlotParam, r: int, gen: torch.Generator) -> torch.Tensor:
    """peft's initial value of this rank's part: A kaiming-uniform (a = √5, fan_in =
    in, as `nn.Linear` and peft's `reset_lora_parameters`) drawn whole from `gen` on
    every rank, so the ranks agree; B zeros. float32 on the slot's device."""
    whole = torch.zeros(slot.full_shape(r))
    if slot.is_a:
        torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=gen)
    return local_part(slot, whole, r)


def local_part(slot: SlotParam, whole: torch.Tensor, r: int) -> torch.Tensor:
    """This rank's part of a whole `[r, in]` / `[out, r]` tensor (a copy, float32, on
    the slot's device).

    Raises:
        ValueError: `whole` is not a rank-`r` tensor of this slot.
    """
    if tuple(whole.shape) != slot.full_shape(r):
        raise ValueError(
            f"{slot.peft_name}: shape {list(whole.shape)}, want {list(slot.full_shape(r))}"
        )
    dim = 1 if slot.is_a else 0
    n = slot.local.shape[dim]
    part = whole.narrow(dim, slot.offset, n)
    return part.to(slot.local.device, torch.float32, copy=True)


def full(slot: SlotParam, part: torch.Tensor, r: int) -> torch.Tensor:
    """The whole rank-`r` tensor from every rank's `part`, float32 on CPU, on every
    rank. Collective (an all-gather of the slot-sized tensor) when sharded."""
    buf = torch.zeros_like(slot.local, dtype=torch.float32)
    buf[slot.region(r)] = part
    p = slot.param
    if hasattr(p, "to_local"):
        from torch.distributed.tensor import DTensor

        buf = DTensor.from_local(
            buf, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        ).full_tensor()
    return buf[slot.region(r)].cpu()


def load_into_slot(
    slots: list[SlotParam], placed: list[tuple[list[torch.Tensor | None], int]]
) -> None:
    """Write sessions into the slot, block k taking `placed[k]` = (its parts, its rank),
    zeros in its region of a layer it does not train (in place, on the sharded storage
    FSDP2 gathers from). The rest of the slot is left as it is: `block_lora` never reads
    it (zeroing the whole slot cost a pass a write of K·R ranks of every layer)."""
    with torch.no_grad():
        for i, slot in enumerate(slots):
            local = slot.local
            for k, (parts, r) in enumerate(placed):
                if parts[i] is None:
                    local[slot.region(r, k)].zero_()
                else:
                    local[slot.region(r, k)].copy_(parts[i])


@contextmanager
def block_lora(
    model: torch.nn.Module, slots: list[SlotParam], rows: list[tuple[int, int]]
) -> Iterator[None]:
    """While open (forward and backward, so a recomputed forward sees it too), each
    targeted layer adds its LoRA term per session instead of peft's whole-slot term:
    session k = `rows[k]` = (n_k, r_k) owns the batch's next n_k rows, which get block
    k's first r_k ranks, h = W0 x + s · B[:, kR : kR + r_k] A[kR : kR + r_k] x (s:
    peft's scaling, 1). Each row
    then pays its session's rank r in LoRA compute, not the slot's K·R, and its
    gradients reach only its block. Equal to peft's term over the zero-padded slot up to
    float rounding (the sums skip only zero terms).

    Args:
        rows: per session, in row order, (its rows, its LoRA rank); the rows add up to
            the batch's.
    """
    from torch.nn.functional import linear

    layers = {model.get_submodule(sl.name.rsplit(".", 3)[0]) for sl in slots}
    per = slots[0].block
    groups, start = [], 0  # (first row, end row, block, rank)
    for k, (n, r) in enumerate(rows):
        groups.append((start, start + n, k, r))
        start += n

    def add_lora(layer: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight  # unsharded now
        x = layer.lora_dropout[ADAPTER](args[0].to(a.dtype))
        parts = []
        for lo, hi, k, r in groups:
            ranks = slice(k * per, k * per + r)
            parts.append(linear(linear(x[lo:hi], a[ranks]), b[:, ranks]))
        return out + (torch.cat(parts) * layer.scaling[ADAPTER]).to(out.dtype)

    handles = [layer.register_forward_hook(add_lora) for layer in layers]
    for layer in layers:
        layer._disable_adapters = True  # peft's forward: the base layer only
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False
        for h in handles:
            h.remove()
