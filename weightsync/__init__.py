"""Weight transports: learner rank 0 → rollout engines, chosen by `weight_sync.type`."""

from weightsync.base import WeightHandle, WeightSyncError, WeightTransport, state_checksum


def make_transport(kind: str) -> WeightTransport:
    """The transport for a recipe's `weight_sync.type`.

    Raises:
        ValueError: an unknown type.
    """
    if kind == "object_store":
        from weightsync.object_store import ObjectStoreTransport

        return ObjectStoreTransport()
    raise ValueError(f"weight_sync.type {kind!r} is not a known transport; use 'object_store'")


__all__ = ["WeightHandle", "WeightSyncError", "WeightTransport", "make_transport", "state_checksum"]
