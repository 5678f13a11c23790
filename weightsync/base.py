"""The weight transport interface: learner rank 0 → every rollout engine.

Concurrency contract (one step, every transport):
  1. the learner finishes its optimizer step, gathers the full state dict on rank 0
     and calls `send(weights, version)`, which returns a small `WeightHandle` at once
     (a transport that streams, like `collective`, keeps sending in the background);
  2. the controller hands that handle to every rollout worker, each of which calls
     `receive(handle)` and loads the tensors as they arrive;
  3. the controller waits for every worker to acknowledge `policy_version == version`
     and then for the learner's `finish()`, before the next `generate`.
A push never runs concurrently with generation on the same engine, and a transport
never blocks the learner's next `train_step`: the learner only waits in `finish()`.
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
        checksum: `state_checksum` of the sent tensors, or None when not requested.
        names: every tensor name sent, so an engine can refuse a push that would leave
            part of its model stale before loading anything.
    """

    version: int
    payload: Any
    num_bytes: int
    checksum: str | None = None
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
    give equal checksums bit for bit; a receiver can compute it while streaming.
    """
    return combine_digests(tensor_digest(n, t) for n, t in named)


class ChecksumTap:
    """Wraps a `(name, tensor)` stream and checksums it on the way through, so an
    engine that repacks weights (vLLM on CPU) can still prove what it was given."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]]):
        self._stream = stream
        self._digests: list[bytes] = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._stream:
            self._digests.append(tensor_digest(name, t))
            yield name, t

    def checksum(self) -> str:
        return combine_digests(self._digests)


class WeightTransport(ABC):
    """One way of moving full weights from the learner to rollout engines."""

    #: True when receivers must first join a group with the sender (`join_group`).
    needs_group: bool = False

    @abstractmethod
    def send(
        self, weights: dict[str, torch.Tensor], version: int, checksum: bool = False
    ) -> WeightHandle:
        """Publish `weights` (already cast to the engine dtype) as `version`.

        Called on learner rank 0 only. Returns at once; engines fetch later.
        """

    @abstractmethod
    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` pairs of a handle, on the engine's side. Tensors may
        be views into transport buffers: the engine copies them before the next pair.

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

    def join_group(self, address: str, rank: int, world_size: int) -> None:
        """Join the sender's group (rank 0 = learner rank 0); only when `needs_group`.

        Raises:
            WeightSyncError: this transport has no group.
        """
        raise WeightSyncError(f"{type(self).__name__} has no group to join")

    def close(self) -> None:
        """Release buffers, files and groups held by this transport."""
        return None


class WeightSyncError(RuntimeError):
    """A push that failed: the message names the engine and the version."""
