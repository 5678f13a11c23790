"""Weight transports: learner rank 0 → rollout engines, chosen by `weight_sync.type`."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.weightsync.base import (
    ChecksumTap,
    WeightHandle,
    WeightSyncError,
    WeightTransport,
    state_checksum,
)

TRANSPORTS = ("object_store", "collective", "filesystem")


@dataclass(frozen=True)
class TransportSettings:
    """Plain values that pick and size a transport (built from the recipe).

    Attributes:
        type: one of `TRANSPORTS`.
        bucket_mb: collective only: MiB per broadcast bucket.
        backend: collective only: 'gloo' (CPU) or 'nccl' (GPU).
        directory: filesystem only: folder of this run's weight files.
        timeout_s: collective only: bound on forming the group and on each broadcast.
    """

    type: str = "object_store"
    bucket_mb: float = 64
    backend: str = "gloo"
    directory: str = "/dev/shm/posttrain"
    timeout_s: float = 300.0


def make_transport(settings: TransportSettings | str) -> WeightTransport:
    """The transport for a recipe's `weight_sync` block (or just its type name).

    Raises:
        ValueError: an unknown type.
    """
    s = TransportSettings(type=settings) if isinstance(settings, str) else settings
    if s.type == "object_store":
        from posttrain.weightsync.object_store import ObjectStoreTransport

        return ObjectStoreTransport()
    if s.type == "collective":
        from posttrain.weightsync.collective import CollectiveTransport

        return CollectiveTransport(s.backend, s.bucket_mb, s.timeout_s)
    if s.type == "filesystem":
        from posttrain.weightsync.filesystem import FilesystemTransport

        return FilesystemTransport(s.directory)
    raise ValueError(f"weight_sync.type {s.type!r} is not a known transport; use one of "
                     f"{', '.join(TRANSPORTS)}")


__all__ = ["TRANSPORTS", "ChecksumTap", "TransportSettings", "WeightHandle", "WeightSyncError",
           "WeightTransport", "make_transport", "state_checksum"]
