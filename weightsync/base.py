"""The weight transport interface: learner rank 0 → every rollout engine.

Concurrency contract (one step, every transport; the order lives in
`weightsync.publish`):
  1. after its optimizer step every learner rank runs `publish(transport, source,
     version)`; rank 0 either gathers the full state dict and calls `send(weights,
     version)`, which returns a small `WeightHandle` at once (a transport that
     broadcasts keeps sending in the background), or, for a transport that
     `can_stream`, makes the handle from the layout alone (`stream_handle`) and
     sends each bucket as soon as its tensors are gathered (`send_stream`);
  2. the controller hands that handle to every rollout worker, each of which calls
     `receive(handle)` and loads the tensors as they arrive;
  3. the controller waits for every worker to acknowledge `policy_version == version`
     and then for the learner's side to end (`finish`), before the next `generate`.
A push never runs concurrently with generation on the same engine.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class WeightHandle:
    """What travels learner → controller → rollout workers instead of the tensors.

    Attributes:
        version: the policy_version these weights are (optimizer steps taken).
        payload: transport-specific reference (a list holding one Ray ObjectRef, a file
            path, or the bucket layout of a broadcast).
        num_bytes: bytes of tensor data sent.
        names: every tensor name sent, so an engine can refuse a push that would leave
            part of its model stale before loading anything.
    """

    version: int
    payload: Any
    num_bytes: int
    names: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """SHA-256 of one tensor's name, dtype, shape and raw bytes."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def combine_digests(digests: Iterable[bytes]) -> str:
    """Order-independent checksum of per-tensor digests (sorted, then hashed)."""
    h = hashlib.sha256()
    for d in sorted(digests):
        h.update(d)
    return h.hexdigest()


def state_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Checksum over names, dtypes, shapes and raw bytes, independent of order.

    Learner and engine compute it over tensors of the same dtype, so equal weights
    give equal checksums bit for bit. For comparing whole states (tests, the service's
    session isolation); the proof of each push is per tensor (weightsync/verify.py).
    """
    return combine_digests(tensor_digest(n, t) for n, t in named)


@dataclass
class PushSource:
    """What a learner rank offers one push: learner → `publish` (same process).

    Attributes:
        tensors: `(name, tensor)` pairs already in the engines' dtype, in `layout`
            order. Producing them may be a collective over the learner group, so every
            rank iterates it to the end; only rank 0's tensors are sent.
        layout: `(name, dtype, global shape)` of every tensor, known before any
            gathering; None when the names are only known after (merged or adapter
            pushes), which rules out streaming.
        meta: extra fields for the handle (e.g. `adapter_config`), from rank 0.
        expected: `{name: fingerprint}` the engines must hold after this push, derived
            by the learner from its own modules rather than from `tensors` (filled on
            rank 0 while `tensors` is consumed); the proof of delivery checks it too
            (`weightsync.verify`). E.g. the base under adapter-only sync.
    """

    tensors: Iterator[tuple[str, torch.Tensor]]
    layout: list[tuple[str, str, tuple[int, ...]]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    expected: dict[str, str] = field(default_factory=dict)


class WeightTransport(ABC):
    """One way of moving full weights from the learner to rollout engines."""

    #: True when receivers must first join a group with the sender (`join_group`).
    needs_group: bool = False
    #: True when the sender can broadcast tensors as they are produced
    #: (`stream_handle` + `send_stream`), so engines receive while the learner gathers.
    can_stream: bool = False
    #: True when every learner rank's `send` is part of a collective (each rank shares
    #: its own copy, e.g. CUDA IPC to its colocated engine); rank 0's handle is pushed.
    every_rank_sends: bool = False
    #: True when `send` and `send_stream` take `seen`, a dict they fill with the
    #: `weightsync.verify.fingerprint` of every tensor they pack, fused with their copy
    #: (complete once the push is delivered on the sender's side: after `finish`).
    fingerprints_sent: bool = False

    @abstractmethod
    def send(self, weights: dict[str, torch.Tensor], version: int) -> WeightHandle:
        """Publish `weights` (already cast to the engine dtype) as `version`.

        Called on learner rank 0 only. Returns at once; engines fetch later.
        """

    @abstractmethod
    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` pairs of a handle, on the engine's side. Tensors may
        be views into transport buffers that the next `receive` reuses: the engine
        copies them into its own weights before this push ends (vLLM's layerwise
        reload holds a layer's tensors until the layer is complete).

        Raises:
            WeightSyncError: the payload is gone, unreadable or incomplete.
        """

    def finish(self, handle: WeightHandle) -> None:
        """Sender side: wait until `handle` is fully delivered (no-op for transports
        whose `send` completes before returning).

        Raises:
            WeightSyncError: the delivery failed or timed out.
        """
        return None

    def stream_handle(
        self, layout: list[tuple[str, str, tuple[int, ...]]], version: int
    ) -> WeightHandle:
        """A handle for a push whose tensors do not exist yet, made from the layout
        alone (only when `can_stream`).

        Raises:
            WeightSyncError: this transport cannot stream.
        """
        raise WeightSyncError(f"{type(self).__name__} cannot stream a push")

    def send_stream(self, stream: Iterator[tuple[str, torch.Tensor]], handle: WeightHandle) -> None:
        """Send `stream` (the tensors of `handle`, in its order) as they are produced;
        blocks until all is delivered (only when `can_stream`).

        Raises:
            WeightSyncError: the stream does not match the layout, or delivery failed.
        """
        raise WeightSyncError(f"{type(self).__name__} cannot stream a push")

    def join_group(self, address: str, rank: int, world_size: int) -> None:
        """Join the push group (rank 0 = learner rank 0) at `address`, a rendezvous
        store hosted by the controller (`GroupStore`); only when `needs_group`.

        Raises:
            WeightSyncError: this transport has no group.
        """
        raise WeightSyncError(f"{type(self).__name__} has no group to join")

    def close(self) -> None:
        """Release buffers, files and groups held by this transport."""
        return None


class WeightSyncError(RuntimeError):
    """A push that failed: the message names the engine and the version."""
