"""Learner ranks on one machine hand their shards of a weight push to rank 0 through
shared memory instead of gloo all-gathers (`weight_sync.shm_gather`, CPU learners).

Why: on CPU, FSDP2's per-parameter `full_tensor()` all-gathers move every byte through
gloo's loopback TCP, to every rank: for SmolLM2-135M on 2 ranks they were ~1.05 s of a
~1.2 s push, the push's critical path (docs/benchmarks.md, "Weight sync ... (C)").
Here each rank > 0 casts its shards to the engines' dtype straight into one flat
`/dev/shm` buffer that rank 0 maps too, rank 0 casts its own straight into the first
rows of its full tensors, the ranks meet at one barrier, and rank 0 copies the other
ranks' rows in: one cast per rank in parallel, one memcpy of the other ranks' bytes
on rank 0, no TCP.

Layout (made once, `ShmGather.create`, a collective): every rank's local shard
shapes (`dist.all_gather_object`), one 64-byte-aligned slot per parameter in each
rank's buffer. FSDP2 shards each parameter along dim 0 in rank order (`Shard(0)`,
`torch.chunk` sizes: the last ranks may hold fewer or no rows), so rank 0 rebuilds a
tensor by stacking the ranks' slots along dim 0. Tensors that are not DTensors
(replicated) are taken from rank 0.

Order of one push (`stream`, every rank, collective):
  1. barrier: rank 0 has finished reading the previous push (so no rank overwrites
     a slot rank 0 still reads);
  2. each rank writes its shards, cast, into its slots (rank 0: its full tensors);
  3. barrier: every slot is written; ranks > 0 are done (they yield nothing);
  4. rank 0 yields full tensors in the policy's order, in buffers it reuses push
     after push (fresh pages cost page faults): valid until the next push starts.
     Every transport is done with them by then (the collective one's `finish`, the
     object store's and filesystem's copies, the delta's clone of its base).

One rank uses it too: it then only casts into the reused full tensors, where a fresh
tensor per push would pay its pages' first-touch faults (0.48 s against 0.18 s a push
of the quickstart on 2 ranks, docs/benchmarks.md).

Limits: every rank on one machine (checked at `create`: otherwise `create` returns
None and the caller all-gathers); plain policies only (merged or adapter-only pushes
gather through `learner/adapters.py`). Memory: one extra copy of each rank's shard in
the engines' dtype (134 MB per rank of 2 for SmolLM2-135M in bf16) and, on rank 0, one
of the full tensors (269 MB), kept between pushes. The `/dev/shm` files
are unlinked as soon as rank 0 mapped them, so nothing is left behind by a crash.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections.abc import Iterator

import torch
import torch.distributed as dist

_ALIGN = 64  # bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `t` (a DTensor) or `t` itself (replicated)."""
    return t.to_local() if hasattr(t, "to_local") else t


class ShmGather:
    """Rank 0's view of every rank's shard buffer, or a rank > 0's own buffer.

    Args:
        names: every tensor of a push, in order (`learner.push.untied_state`).
        shapes: `shapes[r][i]`, the local shape of tensor i on rank r.
        sharded: `sharded[i]`: tensor i is a DTensor sharded along dim 0.
        buffers: `{rank: flat uint8 buffer}` of ranks > 0: all of them on rank 0, its
            own elsewhere.
        dtype: the engines' dtype.
    """

    def __init__(
        self,
        rank: int,
        names: list[str],
        shapes: list[list[tuple[int, ...]]],
        sharded: list[bool],
        buffers: dict[int, torch.Tensor],
        dtype: torch.dtype,
    ):
        self.rank, self.names, self.shapes, self.sharded = rank, names, shapes, sharded
        self.buffers, self.dtype = buffers, dtype
        self.offsets = [_offsets(s, dtype) for s in shapes]
        # Rank 0: the full tensors, reused push after push (fresh pages each push cost
        # page faults); its own shards are written straight into their first rows.
        self.out = [torch.empty(self._full_shape(i), dtype=dtype) for i in range(len(names))]
        if rank != 0:
            self.out = []

    def _full_shape(self, i: int) -> tuple[int, ...]:
        if not self.sharded[i]:
            return self.shapes[0][i]
        rows = sum(
            self.shapes[r][i][0] if self.shapes[r][i] else 0 for r in range(len(self.shapes))
        )
        return (rows, *self.shapes[0][i][1:])

    @classmethod
    def create(
        cls, state: dict[str, torch.Tensor], rank: int, world: int, dtype: torch.dtype
    ) -> ShmGather | None:
        """The gather for a policy's untied state dict `state` (DTensors), or None when
        the ranks are not all on this machine or `/dev/shm` has no room for the buffers
        (the caller then all-gathers). Collective over the default group.

        Raises:
            RuntimeError: the ranks' state dicts differ in names (a broken learner group).
        """
        names = list(state)
        local = [tuple(_local(t).shape) for t in state.values()]
        mine = (socket.gethostname(), os.uname().nodename, names, local)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        if any(e[0] != mine[0] or e[1] != mine[1] for e in everyone):
            return None
        if any(e[2] != names for e in everyone):
            raise RuntimeError(
                f"learner rank {rank}: the ranks' policies differ in tensor names; every "
                "rank must load the same model"
            )
        shapes = [e[3] for e in everyone]
        sizes = [_offsets(s, dtype)[-1] for s in shapes]
        # A /dev/shm too small for the buffers (docker's default is 64 MiB) would end in
        # SIGBUS on the first write: rank 0 checks once and every rank falls back. Rank
        # 0's own tensors are plain memory (`out`): one rank needs no /dev/shm.
        token = [uuid.uuid4().hex if rank == 0 and _shm_fits(sum(sizes[1:])) else None]
        dist.broadcast_object_list(token, src=0)
        if token[0] is None:
            return None
        path = [f"/dev/shm/posttrain-gather-{token[0]}-{r}" for r in range(world)]
        buffers: dict[int, torch.Tensor] = {}
        if rank != 0:  # rank 0 writes its shards into its full tensors (`ShmGather.out`)
            buffers[rank] = torch.from_file(
                path[rank], shared=True, size=max(sizes[rank], 1), dtype=torch.uint8
            )
        dist.barrier()  # every file exists
        if rank == 0:
            for r in range(1, world):
                buffers[r] = torch.from_file(
                    path[r], shared=True, size=max(sizes[r], 1), dtype=torch.uint8
                )
                os.unlink(path[r])  # the mappings stay; nothing left in /dev/shm
        dist.barrier()
        sharded = [hasattr(t, "to_local") for t in state.values()]
        return cls(rank, names, shapes, sharded, buffers, dtype)

    def _slot(self, r: int, i: int) -> torch.Tensor:
        shape = self.shapes[r][i]
        start = self.offsets[r][i]
        n = math.prod(shape) * self.dtype.itemsize
        return self.buffers[r][start : start + n].view(self.dtype).view(shape)

    def stream(self, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors of `state` in the engines' dtype, on rank 0 (nothing elsewhere).
        Collective: every rank iterates it to the end at once.

        Raises:
            RuntimeError: `state` has other names than at `create`.
        """
        if list(state) != self.names:
            raise RuntimeError(
                f"learner rank {self.rank}: the policy's tensors changed since the push "
                "layout was made (a model swapped under the learner?)"
            )
        dist.barrier()  # rank 0 has read the previous push
        for i, t in enumerate(state.values()):
            if self.rank == 0:
                own = self.out[i][: self.shapes[0][i][0]] if self.sharded[i] else self.out[i]
                own.copy_(_local(t.detach()))
            elif self.sharded[i]:
                self._slot(self.rank, i).copy_(_local(t.detach()))
        dist.barrier()  # every slot written
        if self.rank != 0:
            return
        for i, name in enumerate(self.names):
            full = self.out[i]
            if self.sharded[i]:
                at = self.shapes[0][i][0]
                for r in range(1, len(self.shapes)):
                    rows = self.shapes[r][i][0]
                    if rows:
                        full[at : at + rows].copy_(self._slot(r, i))
                        at += rows
            yield name, full


def _shm_fits(nbytes: int, where: str = "/dev/shm") -> bool:
    """Whether `where` has room for `nbytes` more (with 10% to spare), else False (also
    when it does not exist)."""
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 1.1 * nbytes


def _offsets(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[int]:
    """Byte offset of each slot in one rank's buffer, then the buffer's size."""
    out, at = [], 0
    for s in shapes:
        out.append(at)
        at += -(-math.prod(s) * dtype.itemsize // _ALIGN) * _ALIGN
    return [*out, at]
