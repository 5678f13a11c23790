"""Proof of delivery: after every push each engine shows, tensor by tensor, that it got
exactly the bytes the learner sent (`weight_sync.verify_checksum`, on by default).

What is compared, per tensor name: the xxh3-64 hash of dtype, shape and the raw bytes
in the engines' dtype (bf16 as its 16-bit patterns), so one flipped bit anywhere in a
tensor changes its fingerprint.
  learner rank 0: the tensors as they go into the transport (`FingerprintTap` inside
      `publish`);
  engine: what it holds after the load where it keeps the checkpoint layout
      (`engine: hf`: its parameters and buffers, or the PEFT adapter's tensors), else
      what it handed to its loader (`engine: vllm` repacks linear weights into oneDNN's
      blocked layout on CPU and keeps no plain copy, so its parameters cannot be
      compared byte for byte; the tensors given to `reload_weights` are).
With an adapter the engine also reports the policy_version of the adapter its next
generate request will run with (`active_adapter`): an adapter that was loaded but is
not active fails the check.

The controller (`weightsync.push`) compares both sides after every engine acknowledged
and stops the run at the first difference, naming the engine and the tensor.

Cost: one read of every sent byte on each side, at about 10 GB/s per core (xxh3;
0.031 s for SmolLM2-135M's 269 MB on a quiet machine C, memory-bound). A transport
that copies the bytes anyway fuses the hash into that copy (`copy_fingerprint`: 1 MiB
at a time, hashed while in cache): the collective transport's sender does, for 0.006 s
over its copy on a quiet machine; under load (other processes sharing the cores'
caches) 0.02-0.04 s, about a separate pass (docs/benchmarks.md). Measured in
bench/weight_sync.py and bench/push_path.py.

Limits: it proves the bytes, not the numerics of the engine's kernels (logprob parity
tests do that); for vLLM it proves what reached `reload_weights`, not vLLM's repack.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import xxhash

from .base import WeightSyncError


def fingerprint(t: torch.Tensor) -> str:
    """xxh3-64 (hex) of one tensor's dtype, shape and raw bytes (copied to contiguous
    CPU memory first when it is not already)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = xxhash.xxh3_64(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


#: Bytes copied, then hashed while still in cache, per step of `copy_fingerprint`.
_CHUNK = 1 << 20


def copy_fingerprint(dst: torch.Tensor, t: torch.Tensor) -> str:
    """Copy `t`'s raw bytes into the flat uint8 CPU tensor `dst` (exactly its size)
    and return `fingerprint(t)`, hashing each 1 MiB right after copying it (from cache:
    on a quiet machine the hash then costs about a fifth of a separate pass).

    Raises:
        ValueError: `dst` is not `t`'s size in bytes.
    """
    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if dst.numel() != src.numel():
        raise ValueError(f"copy_fingerprint: {dst.numel()} bytes for a {src.numel()}-byte tensor")
    h = xxhash.xxh3_64(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if dst.device.type != "cpu":  # a GPU bucket: copy, then hash the source once
        dst.copy_(src)
        if src.numel():
            h.update(src.cpu().numpy())
        return h.hexdigest()
    out = dst.numpy()
    for at in range(0, src.numel(), _CHUNK):
        dst[at : at + _CHUNK].copy_(src[at : at + _CHUNK])
        h.update(out[at : at + _CHUNK])
    return h.hexdigest()


def fingerprints(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """`{name: fingerprint}` of every pair."""
    return {n: fingerprint(t) for n, t in named}


class FingerprintTap:
    """Wraps a `(name, tensor)` stream and fingerprints each tensor on the way through
    (before the consumer may modify or drop it)."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]]):
        self._stream = stream
        self.seen: dict[str, str] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._stream:
            self.seen[name] = fingerprint(t)
            yield name, t


@dataclass(frozen=True)
class Delivery:
    """One side's account of one push: learner rank 0 → controller, engine → controller.

    Attributes:
        version: the policy_version pushed.
        fingerprints: `{tensor name: fingerprint}` of what was sent (learner) or what
            the engine holds / loaded (engine), under the names that were sent.
        adapter: whether the push was an adapter (the engine must then serve it).
        active_adapter: engine side: the policy_version of the adapter its next
            generate request runs with (None: none active).
        where: engine side: what was fingerprinted ('held' or 'loaded').
        adapter_name: a named adapter's name (`meta["adapter_name"]`, a service
            session's sampler weights); `active_adapter` is then the version a request
            by that name runs with. None: the recipe's weights or single adapter.
    """

    version: int
    fingerprints: dict[str, str] = field(default_factory=dict)
    adapter: bool = False
    active_adapter: int | None = None
    where: str = "sent"
    adapter_name: str | None = None


class DeliveryError(WeightSyncError):
    """An engine holds other bytes than the learner sent, or does not serve the pushed
    adapter: the run stops (a retry would hide a corrupting transport or engine)."""


def check_delivery(sent: Delivery, got: Delivery, engine: int) -> None:
    """Raise unless engine `engine` holds exactly what the learner sent.

    Raises:
        DeliveryError: another version, a tensor missing or differing (named, with
            both fingerprints), or, for an adapter push, the adapter not active in the
            engine's next generate request.
    """
    v = sent.version
    if got.adapter_name != sent.adapter_name:
        raise DeliveryError(
            f"rollout engine {engine}: its delivery report is for adapter "
            f"{got.adapter_name!r}, not the pushed {sent.adapter_name!r}"
        )
    if got.version != v:
        raise DeliveryError(
            f"rollout engine {engine}: its delivery report is for policy_version "
            f"{got.version}, not the pushed {v}"
            + (f" of adapter {sent.adapter_name!r}" if sent.adapter_name else "")
        )
    if missing := sorted(set(sent.fingerprints) - set(got.fingerprints)):
        raise DeliveryError(
            f"rollout engine {engine}: tensor {missing[0]!r} of policy_version {v} was sent "
            f"but the engine never {got.where} it ({len(missing)} missing)"
        )
    for name, fp in sent.fingerprints.items():
        if got.fingerprints[name] != fp:
            raise DeliveryError(
                f"rollout engine {engine}: tensor {name!r} of policy_version {v} differs "
                f"from the learner's (engine {got.where} {got.fingerprints[name]}, learner "
                f"sent {fp}): the weights were corrupted on the way or in the load; the run "
                "stops so that no step samples from weights the learner does not have"
            )
    if sent.adapter and got.active_adapter != v:
        active = got.active_adapter
        serves = "no adapter" if active is None else f"the adapter of policy_version {active}"
        named = f" {sent.adapter_name!r}" if sent.adapter_name else ""
        by = " by that name" if sent.adapter_name else ""
        raise DeliveryError(
            f"rollout engine {engine}: the adapter{named} of policy_version {v} was loaded but "
            f"its next generate request{by} would run with {serves} (base model or a stale "
            "adapter)"
        )
