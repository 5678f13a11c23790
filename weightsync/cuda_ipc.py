"""Weights through CUDA IPC handles: colocated learner rank i → engine i on their
shared GPU (`weight_sync.type: cuda_ipc`, needs `resources.colocate` and `device: cuda`).

Each learner rank already holds the full tensors of a push after FSDP2's all-gather
(`learner/push.py` gathers on every rank). Every rank turns its tensors into IPC
handles (`torch.multiprocessing.reductions.reduce_tensor`: a few hundred bytes per
tensor, no copy), the handles of all ranks are gathered on rank 0 keyed by each GPU's
UUID, and that one `WeightHandle` goes to every engine. An engine picks the entry of
its own GPU and opens the tensors in place (`rebuild_cuda_tensor`): the learner's
memory, read by the engine, which copies it into its own weights (a device-to-device
copy on one GPU). No NCCL, no host memory.

Concurrency: `send` is a collective over the learner group (every rank calls it, see
`weightsync.publish`); the ranks keep their tensors alive until `finish`, which runs
after every engine acknowledged the version (so an engine never reads freed memory).

Limits: both processes must see the same physical GPU (the UUID match); the device
index in a handle is rewritten to the engine's current device, since each actor sees its
GPU as `cuda:0`. CPU tensors have no CUDA handles; on CPU colocated runs use the other
transports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .base import WeightHandle, WeightSyncError, WeightTransport

# Position of `storage_device` in rebuild_cuda_tensor's arguments (torch 2.x).
_DEVICE_ARG = 6


def gpu_uuid(device: torch.device | None = None) -> str:
    """The physical GPU's UUID (equal in every process that sees that GPU), or 'cpu'."""
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if (torch.cuda.is_available())
            else torch.device("cpu")
        )
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def share(weights: dict[str, torch.Tensor]) -> list[tuple[str, Any, tuple]]:
    """`(name, rebuild_fn, args)` per tensor: what another process needs to open it in
    place (`reduce_tensor`); plain picklable values for CUDA tensors. Tensors are made
    contiguous first (the caller must keep the returned tensors' owners alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return [(name, *reduce_tensor(t.detach().contiguous())) for name, t in weights.items()]


def open_shared(
    entries: list[tuple[str, Any, tuple]], device_index: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rebuild `share`'s tensors in this process. CUDA entries get `device_index` (the
    engine's current device by default) in place of the sender's index, which is its
    own numbering of the same GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    for name, fn, args in entries:
        if fn is rebuild_cuda_tensor:
            index = torch.cuda.current_device() if device_index is None else device_index
            args = (*args[:_DEVICE_ARG], index, *args[_DEVICE_ARG + 1 :])
        yield name, fn(*args)


class CudaIpcTransport(WeightTransport):
    """`weight_sync.type: cuda_ipc` (see the module docstring)."""

    every_rank_sends = True

    def __init__(self) -> None:
        self._kept: dict[str, torch.Tensor] | None = None

    def send(self, weights: dict[str, torch.Tensor], version: int) -> WeightHandle:
        """Collective over the learner group: every rank shares its tensors; returns
        the handle with every GPU's entries (rank 0's is the one pushed).

        Raises:
            WeightSyncError: a tensor is not on a GPU.
        """
        import torch.distributed as dist

        if any(t.device.type != "cuda" for t in weights.values()):
            raise WeightSyncError(
                "weight_sync.type cuda_ipc needs the learner's tensors on a "
                "GPU (resources.device: cuda)"
            )
        # Contiguous copies where needed, kept alive until finish: engines read them.
        weights = {n: t.detach().contiguous() for n, t in weights.items()}
        self._kept = weights
        mine = (gpu_uuid(next(iter(weights.values())).device), share(weights))
        world = dist.get_world_size() if dist.is_initialized() else 1
        every: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        return WeightHandle(
            version=version,
            payload=dict(every),
            num_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
            names=tuple(weights),
        )

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of the learner rank on this engine's GPU, opened in place.

        Raises:
            WeightSyncError: no learner rank shares this engine's GPU.
        """
        uuid = gpu_uuid()
        if uuid not in handle.payload:
            raise WeightSyncError(
                f"cuda_ipc: no learner rank is on this engine's GPU ({uuid}); learner ranks "
                f"are on {sorted(handle.payload)}. Colocate engines with learner ranks "
                "(resources.colocate: true, rollout.gpus <= learner.gpus)"
            )
        yield from open_shared(handle.payload[uuid])

    def finish(self, handle: WeightHandle) -> None:
        self._kept = None
        torch.cuda.empty_cache()

    def close(self) -> None:
        self._kept = None
