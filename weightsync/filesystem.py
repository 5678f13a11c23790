"""Weights as a safetensors file under a shared directory (`/dev/shm` by default).

`send` writes `policy_v{version}.safetensors` (to a temporary name, then renamed, so a
reader never sees half a file) and removes versions older than the previous one;
`receive` memory-maps the file and yields its tensors. Works across processes on one
node, or across nodes when `dir` is a shared filesystem. It is also the natural
transport for adapters, whose files are small.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .base import WeightHandle, WeightSyncError, WeightTransport


class FilesystemTransport(WeightTransport):
    """`weight_sync.type: filesystem`.

    Args:
        directory: folder for the files (created); one per run.
    """

    def __init__(self, directory: str):
        self.dir = Path(directory)

    def send(self, weights: dict[str, torch.Tensor], version: int) -> WeightHandle:
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"policy_v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        # safetensors refuses shared storage (tied weights): save each name's own copy.
        seen: set[int] = set()
        tensors = {}
        for name, t in weights.items():
            t = t.detach().contiguous()
            tensors[name] = t.clone() if t.data_ptr() in seen else t
            seen.add(t.data_ptr())
        try:
            save_file(tensors, str(tmp), metadata={"policy_version": str(version)})
            os.replace(tmp, path)
        except OSError as e:
            raise WeightSyncError(f"could not write policy_version {version} to {path}: {e}") from e
        for old in self.dir.glob("policy_v*.safetensors"):
            v = old.stem.removeprefix("policy_v")
            if v.isdigit() and int(v) < version - 1:
                old.unlink(missing_ok=True)
        return WeightHandle(
            version=version,
            payload=str(path),
            num_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
            names=tuple(weights),
        )

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        try:
            f = safe_open(handle.payload, framework="pt")
        except (OSError, RuntimeError) as e:  # missing or truncated file
            raise WeightSyncError(
                f"could not open policy_version {handle.version} at {handle.payload}: {e}"
            ) from e
        with f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    def close(self) -> None:
        for p in self.dir.glob("policy_v*.safetensors"):
            p.unlink(missing_ok=True)
        try:
            self.dir.rmdir()  # the run's own folder, once empty
        except OSError:
            pass
