"""How a push packs tensors into buckets: each bucket one flat uint8 buffer holding
several tensors back to back at 64-byte-aligned offsets (weightsync/collective.py sends
a bucket per broadcast; bench/push_path.py times the packing)."""

from __future__ import annotations

import math

import torch

_ALIGN = 64  # bytes


def tensor_meta(weights: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    """`(name, dtype, shape)` of each tensor, in order, dtype as a string (`"bfloat16"`)."""
    return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in weights.items()]


def bucket_layout(
    weights: dict[str, torch.Tensor] | list[tuple[str, str, tuple[int, ...]]], bucket_bytes: int
) -> list[dict]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` bytes; `weights`
    is the tensors or just their `tensor_meta` (a layout can be made before the tensors
    exist, for a streamed push).

    Returns:
        `[{"size": bytes, "entries": [(name, dtype, shape, offset, nbytes), ...]}, ...]`;
        dtype as a string (`"bfloat16"`), offsets in bytes within the bucket, each a
        multiple of 64.
    """
    meta = tensor_meta(weights) if isinstance(weights, dict) else weights
    buckets: list[dict] = []
    cur: dict = {"size": 0, "entries": []}
    for name, dtype, shape in meta:
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        if cur["entries"] and cur["size"] + nbytes > bucket_bytes:
            buckets.append(cur)
            cur = {"size": 0, "entries": []}
        cur["entries"].append((name, dtype, tuple(shape), cur["size"], nbytes))
        # Offsets aligned so every entry can be viewed as its dtype in place.
        cur["size"] += -(-nbytes // _ALIGN) * _ALIGN
    if cur["entries"]:
        buckets.append(cur)
    return buckets
