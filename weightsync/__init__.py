"""Weight transports: learner rank 0 → rollout engines, chosen by `weight_sync.type`."""

from __future__ import annotations

from dataclasses import dataclass

from .base import (
    PushSource,
    WeightHandle,
    WeightSyncError,
    WeightTransport,
    state_checksum,
)
from .delta import DeltaReceiver, DeltaSender
from .publish import GroupStore, publish, push
from .verify import (
    Delivery,
    DeliveryError,
    FingerprintTap,
    check_delivery,
    fingerprint,
    fingerprints,
)

TRANSPORTS = ("object_store", "collective", "filesystem", "cuda_ipc")


@dataclass(frozen=True)
class TransportSettings:
    """Plain values that pick and size a transport (built from the recipe).

    Attributes:
        type: one of `TRANSPORTS`.
        bucket_mb: collective only: MiB per broadcast bucket.
        backend: collective only: 'gloo' (CPU) or 'nccl' (GPU).
        directory: filesystem only: folder of this run's weight files.
        timeout_s: collective only: bound on forming the group and on each broadcast.
        checksum: proof of delivery (weightsync/verify.py): learner rank 0 and every
            engine fingerprint each tensor of a push; the controller compares them.
        delta: send only the elements that changed since the last push
            (weightsync/delta.py); engines keep a copy of the last push.
        adapter_only: with an adapter, push only its tensors (engines serve base +
            adapter) instead of merged full weights.
        group_address: collective only: `host:port` of the run's `GroupStore`; each
            member joins the push group when its transport is made (`make_transport`
            with a rank), so joining is part of each role's set-up.
        group_world: learner rank 0 plus every engine.
        shm_gather: CPU learner ranks on one machine hand their shards to rank 0
            through shared memory instead of gloo all-gathers (learner/shm_gather.py).
        shm_broadcast: collective on gloo: when every engine shares learner rank 0's
            /dev/shm, buckets are written there and only a signal goes over gloo
            (weightsync/collective.py).
    """

    type: str = "object_store"
    bucket_mb: float = 64
    backend: str = "gloo"
    directory: str = "/dev/shm/posttrain"
    timeout_s: float = 300.0
    checksum: bool = True
    delta: bool = False
    adapter_only: bool = False
    group_address: str | None = None
    group_world: int = 0
    shm_gather: bool = True
    shm_broadcast: bool = True


def make_transport(settings: TransportSettings | str, rank: int | None = None) -> WeightTransport:
    """The transport for a recipe's `weight_sync` block (or just its type name). With a
    `rank` and a `group_address`, a group transport joins the push group as `rank`
    (blocking until every member joined).

    Raises:
        ValueError: an unknown type.
        WeightSyncError: the group did not form within `timeout_s`.
    """
    s = TransportSettings(type=settings) if isinstance(settings, str) else settings
    transport = _build(s)
    if rank is not None and transport.needs_group and s.group_address:
        transport.join_group(s.group_address, rank, s.group_world)
    return transport


def _build(s: TransportSettings) -> WeightTransport:
    if s.type == "object_store":
        from .object_store import ObjectStoreTransport

        return ObjectStoreTransport()
    if s.type == "collective":
        from .collective import CollectiveTransport

        return CollectiveTransport(s.backend, s.bucket_mb, s.timeout_s, s.shm_broadcast)
    if s.type == "filesystem":
        from .filesystem import FilesystemTransport

        return FilesystemTransport(s.directory)
    if s.type == "cuda_ipc":
        from .cuda_ipc import CudaIpcTransport

        return CudaIpcTransport()
    raise ValueError(
        f"weight_sync.type {s.type!r} is not a known transport; use one of {', '.join(TRANSPORTS)}"
    )


__all__ = [
    "TRANSPORTS",
    "DeltaReceiver",
    "DeltaSender",
    "Delivery",
    "DeliveryError",
    "FingerprintTap",
    "GroupStore",
    "PushSource",
    "TransportSettings",
    "WeightHandle",
    "WeightSyncError",
    "WeightTransport",
    "check_delivery",
    "fingerprint",
    "fingerprints",
    "make_transport",
    "publish",
    "push",
    "state_checksum",
]
