"""Weights through Ray's object store.

Tensors become numpy arrays (bf16 carried as its raw 16-bit pattern, since numpy has
no bfloat16) so Ray serialises them as out-of-band buffers: one copy into shared
memory on `send`, zero-copy reads on `receive` in any process on the node.

Limits: the object lives until its last reference goes; the learner keeps only the
newest handle, so at most two versions sit in the store at once. Across machines Ray
copies the object once per node that reads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import torch

from .base import WeightHandle, WeightSyncError, WeightTransport

# dtypes numpy cannot hold are sent as same-width integers and viewed back.
_VIEW_AS = {torch.bfloat16: torch.int16}


def _to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    t = t.detach().contiguous().cpu()
    view = _VIEW_AS.get(t.dtype)
    arr = (t.view(view) if view is not None else t).numpy()
    return arr, str(t.dtype).removeprefix("torch.")


class ObjectStoreTransport(WeightTransport):
    """`weight_sync.type: object_store`."""

    def __init__(self) -> None:
        self._last: WeightHandle | None = None

    def send(self, weights: dict[str, torch.Tensor], version: int) -> WeightHandle:
        import ray

        arrays, dtypes, total = {}, {}, 0
        for name, t in weights.items():
            arrays[name], dtypes[name] = _to_numpy(t)
            total += arrays[name].nbytes
        ref = ray.put({"arrays": arrays, "dtypes": dtypes})
        # A list keeps Ray from resolving the ref when the handle is passed as an argument.
        self._last = WeightHandle(
            version=version, payload=[ref], num_bytes=total, names=tuple(weights)
        )
        return self._last

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        import ray

        try:
            obj = ray.get(handle.payload[0], timeout=120)
        except Exception as e:  # Ray raises several types (lost owner, timeout, ...)
            raise WeightSyncError(
                f"could not fetch weights of policy_version {handle.version} from the Ray "
                f"object store: {type(e).__name__}: {e}"
            ) from e
        for name, arr in obj["arrays"].items():
            with warnings.catch_warnings():  # read-only view; the engine copies it
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(np.asarray(arr))
            dtype = getattr(torch, obj["dtypes"][name])
            yield name, (t.view(dtype) if dtype in _VIEW_AS else t)
