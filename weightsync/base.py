"""The weight transport interface: learner rank 0 → every rollout engine.

Order of operations (one step): the learner finishes its optimizer step, gathers the
full state dict and calls `send(weights, version)`, which returns a small
`WeightHandle`; the controller hands that handle to every rollout worker, each of
which calls `receive(handle)` and loads the tensors; the controller waits for every
worker to acknowledge `policy_version == version` before the next `generate`. A
transport never blocks the learner waiting for engines.
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
        payload: transport-specific reference (e.g. a list holding one Ray ObjectRef).
        num_bytes: bytes of tensor data sent.
        checksum: `state_checksum` of the sent tensors, or None when not requested.
    """

    version: int
    payload: Any
    num_bytes: int
    checksum: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def state_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes, in name order.

    Learner and engine compute it over tensors of the same dtype, so equal weights
    give equal checksums bit for bit.
    """
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class WeightTransport(ABC):
    """One way of moving full weights from the learner to rollout engines."""

    @abstractmethod
    def send(
        self, weights: dict[str, torch.Tensor], version: int, checksum: bool = False
    ) -> WeightHandle:
        """Publish `weights` (already cast to the engine dtype) as `version`.

        Called on learner rank 0 only. Returns at once; engines fetch later.
        """

    @abstractmethod
    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` pairs of a handle, on the engine's side.

        Raises:
            WeightSyncError: the payload is gone or unreadable.
        """


class WeightSyncError(RuntimeError):
    """A push that failed: the message names the engine and the version."""
