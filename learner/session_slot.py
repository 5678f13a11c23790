"""The one LoRA adapter slot that every session of a learner rank trains through, and
how a session's tensors map onto this rank's shard of it.

The slot is a peft LoRA adapter of rank R = `sessions.max_rank` with lora_alpha = R, so
its scale alpha / r is 1, as Tinker's alpha = rank gives for every rank. A session of
rank r ≤ R uses the first r rows of each `lora_A [R, in]` and the first r columns of
each `lora_B [out, R]`; the rest of the slot holds zeros while it runs. That is exact:
with B[:, j] = 0 and A[j] = 0 for j ≥ r, both gradients are 0 (∂A[j] = B[:, j]ᵀ g xᵀ,
∂B[:, j] = g (A[j] x)ᵀ), AdamW leaves a zero with zero gradient at zero, and
h = W0 x + B[:, :r] A[:r] x is the rank-r adapter's output. A session that trains only
the attention (or only the MLP) projections leaves the others at zero the same way.

FSDP2 shards every slot tensor on dim 0 in `torch.chunk` pieces: rank k holds rows
[k·c, min((k + 1)·c, n)), c = ⌈n / world⌉. A session keeps only its region of this
rank's shard (`Region`): for A the rows below r, for B the first r columns, so each
session costs its true rank on every rank. `full` and `local_part` move between a
region and the whole `[r, in]` / `[out, r]` tensor (`full` is a collective).
"""

from __future__ import annotations

import math
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
        param: the FSDP2 parameter (a DTensor sharded on dim 0, or a plain tensor).
        module: the targeted layer's short name (`q_proj`).
        is_a: True for `lora_A [R, in]`, False for `lora_B [out, R]`.
        offset: the global row of this rank's first local row.
    """

    name: str
    param: torch.nn.Parameter
    module: str
    is_a: bool
    offset: int

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard (a view FSDP2 all-gathers from)."""
        p = self.param
        return p.to_local() if hasattr(p, "to_local") else p

    @property
    def peft_name(self) -> str:
        """The name in a PEFT adapter file (`...q_proj.lora_A.weight`)."""
        return self.name.replace(f".{ADAPTER}.", ".")

    def region(self, r: int) -> tuple[slice, slice]:
        """The part of the local shard a rank-`r` session uses (may be empty)."""
        if self.is_a:
            rows = self.local.shape[0]
            return slice(0, max(0, min(rows, r - self.offset))), slice(None)
        return slice(None), slice(0, r)

    def full_shape(self, r: int) -> tuple[int, int]:
        """The whole tensor of a rank-`r` session: `[r, in]` (A) or `[out, r]` (B)."""
        out, inp = self.param.shape
        return (r, inp) if self.is_a else (out, r)


def slot_params(model: torch.nn.Module, rank: int, world: int) -> list[SlotParam]:
    """The slot's trainable tensors in `named_parameters` order (the same on every rank).

    Raises:
        RuntimeError: FSDP2 sharded a tensor other than in `torch.chunk` pieces on dim 0
            (the region arithmetic would then be wrong).
    """
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        kind = parts[-3]  # ... q_proj . lora_A . default . weight
        if kind not in ("lora_A", "lora_B"):
            raise RuntimeError(f"session slot: unexpected trainable tensor {name}")
        rows = p.shape[0]
        chunk = math.ceil(rows / world)
        offset = min(rank * chunk, rows)
        slot = SlotParam(name, p, parts[-4], kind == "lora_A", offset)
        if slot.local.shape[0] != max(0, min(chunk, rows - offset)):
            raise RuntimeError(f"session slot: {name} is not sharded in torch.chunk pieces")
        out.append(slot)
    return out


def uses(slot: SlotParam, targets: tuple[str, ...]) -> bool:
    return slot.module in targets


def init_region(slot: SlotParam, r: int, gen: torch.Generator) -> torch.Tensor:
    """peft's initial value of this rank's region: A kaiming-uniform (a = √5, fan_in =
    in, as `nn.Linear` and peft's `reset_lora_parameters`) drawn whole from `gen` on
    every rank, so the ranks agree; B zeros. float32 on the slot's device."""
    if slot.is_a:
        whole = torch.empty(slot.full_shape(r))
        torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=gen)
        return local_part(slot, whole, r)
    rows, cols = slot.region(r)
    return torch.zeros_like(slot.local[rows, cols], dtype=torch.float32)


def local_part(slot: SlotParam, whole: torch.Tensor, r: int) -> torch.Tensor:
    """This rank's region of a whole `[r, in]` / `[out, r]` tensor (a copy, float32,
    on the slot's device).

    Raises:
        ValueError: `whole` is not a rank-`r` tensor of this slot.
    """
    if tuple(whole.shape) != slot.full_shape(r):
        raise ValueError(
            f"{slot.peft_name}: shape {list(whole.shape)}, want {list(slot.full_shape(r))}"
        )
    n = slot.local.shape[0]
    rows, cols = slot.region(r)
    part = whole[slot.offset : slot.offset + n]  # this rank's rows (dim 0 is sharded)
    return part[rows, cols].to(slot.local.device, torch.float32, copy=True)


def full(slot: SlotParam, part: torch.Tensor, r: int) -> torch.Tensor:
    """The whole rank-`r` tensor from every rank's region `part`, float32 on CPU, on
    every rank. Collective (an all-gather of the slot-sized tensor) when sharded."""
    buf = torch.zeros_like(slot.local, dtype=torch.float32)
    rows, cols = slot.region(r)
    buf[rows, cols] = part
    p = slot.param
    if hasattr(p, "to_local"):
        from torch.distributed.tensor import DTensor

        buf = DTensor.from_local(
            buf, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        ).full_tensor()
    return (buf[:r] if slot.is_a else buf[:, :r]).cpu()


def load_into_slot(slots: list[SlotParam], parts: list[torch.Tensor | None], r: int) -> None:
    """Write a session's regions into the slot, zeros everywhere else (in place, on
    the sharded storage FSDP2 gathers from)."""
    with torch.no_grad():
        for slot, part in zip(slots, parts, strict=True):
            local = slot.local
            local.zero_()
            if part is not None:
                rows, cols = slot.region(r)
                local[rows, cols].copy_(part)
