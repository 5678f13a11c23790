"""Weights broadcast over a torch.distributed group: learner rank 0 → every engine.

The group is made at run time, apart from the learner's FSDP group and from vLLM's
own: rank 0 is learner rank 0 (it hosts the rendezvous `TCPStore`), ranks 1..N are the
rollout engines' processes. Backend: gloo on CPU, NCCL on GPUs (same code, buffers on
the current CUDA device).

Tensors travel in buckets of about `bucket_mb` MiB: each bucket is one flat uint8
buffer holding several tensors back to back (a tensor larger than a bucket gets a bucket
of its own), so a push costs one broadcast per bucket instead of one per tensor, and
receivers load a bucket's tensors while the next one is on the wire. The layout
(names, dtypes, shapes, offsets) travels in the `WeightHandle`; the bytes do not.

Buffers: on CPU (gloo) each side keeps its bucket buffers from push to push, one per
bucket index: a fresh 64 MiB buffer is fresh pages, and copying into them took about 6x
as long as into kept ones (first-touch page faults; docs/benchmarks.md), on both sides
of every push. So a received tensor is valid until the next `receive`
starts (every engine copies it into its own weights within the push); the sender's
buffers until `finish` (or the end of `send_stream`). Memory: one copy of the pushed
bytes on learner rank 0 and on each engine. On GPUs (NCCL) buffers are allocated per
push: the CUDA caching allocator reuses its blocks, and GPU memory is the scarcer.

Shared memory (`shm=True`, gloo only): when every receiver can read rank 0's probe
file in /dev/shm (checked once, as the group forms), rank 0 packs each bucket into a
/dev/shm file named in the handle and broadcasts only the bucket's index; receivers map
the files before joining the first broadcast, so the sender unlinks them once the push
is delivered and keeps the mappings (and the receivers theirs) while the sizes hold.
One copy of the bytes for rank 0 and every engine, no loopback TCP
(docs/weight-sync.md).

Concurrency: `send` starts the broadcast on a background thread and returns the handle;
every engine must call `receive(handle)` (they block in the broadcast until all ranks
join); the learner calls `finish(handle)` afterwards to surface errors. The group's
timeout (`timeout_s`) bounds every broadcast, so a dead engine fails the push with an
error instead of hanging it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import torch

from . import shm as shm_files
from .base import WeightHandle, WeightSyncError, WeightTransport
from .buckets import bucket_layout
from .verify import copy_fingerprint

_MiB = 1 << 20
#: Counter in the rendezvous store: how many members have joined through it.
_JOINS_KEY = "posttrain/push_group_joins"


def _device(backend: str) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else (torch.device("cpu"))
    )


class CollectiveTransport(WeightTransport):
    """`weight_sync.type: collective`.

    Args:
        backend: 'gloo' (CPU) or 'nccl' (GPU), chosen from `resources.device`.
        bucket_mb: bucket size, MiB.
        timeout_s: bound on every broadcast and on forming the group, seconds.
    """

    needs_group = True
    can_stream = True
    fingerprints_sent = True

    def __init__(
        self,
        backend: str = "gloo",
        bucket_mb: float = 64,
        timeout_s: float = 300.0,
        shm: bool = True,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"collective backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        self.backend = backend
        self.bucket_bytes = int(bucket_mb * _MiB)
        self.timeout = timedelta(seconds=timeout_s)
        self.pg = None
        self.rank = -1
        self._store = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._kept: dict[tuple[str, int], torch.Tensor] = {}  # (side, bucket index) -> buffer
        # Shared-memory buckets (the module's "Shared memory"): asked for, and on rank 0
        # whether every receiver reads this machine's /dev/shm (found at join).
        self.shm_asked = shm and backend == "gloo"
        self.shm = False
        self._files = shm_files.ShmBuckets()

    def _buffer(self, side: str, index: int, size: int) -> torch.Tensor:
        """Bucket `index`'s flat uint8 buffer of `size` bytes for `side` ('send' or
        'recv'): kept from push to push on CPU (see the module's "Buffers"), new on GPUs."""
        device = _device(self.backend)
        if device.type != "cpu":
            return torch.empty(size, dtype=torch.uint8, device=device)
        buf = self._kept.get((side, index))
        if buf is None or buf.numel() != size:
            buf = self._kept[(side, index)] = torch.empty(size, dtype=torch.uint8)
        return buf

    def join_group(self, address: str, rank: int, world_size: int) -> None:
        """Form the broadcast group; every rank calls it at once. `address` is
        `host:port` of the rendezvous store the controller hosts (`GroupStore`), one
        store per group: gloo and NCCL leave each rank's address in the store, so a
        second group there would reach the first group's processes (connect to them if
        they live, and hang until `timeout_s`; be refused if they died).

        Raises:
            WeightSyncError: the group did not form within `timeout_s`, or the store
                already formed a group (more than `world_size` joins), at once.
        """
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        try:
            self._store = dist.TCPStore(
                host, int(port), None, is_master=False, timeout=self.timeout
            )
            joins = self._store.add(_JOINS_KEY, 1)
        except (RuntimeError, ValueError) as e:  # c10d raises DistStoreError/RuntimeError
            raise self._join_error(address, rank, world_size, e) from e
        if joins > world_size:
            self._store = None
            raise WeightSyncError(
                f"rank {rank}: the rendezvous store at {address} already formed a push "
                f"group ({joins} joins for {world_size} ranks); its members' addresses stay "
                "in it, so a second group would connect to the first one's processes. Make "
                "a new GroupStore for each group (as recipes/roles.reform_push_group does)"
            )
        probe = shm_files.make_probe(self._store) if rank == 0 and self.shm_asked else None
        try:
            if self.backend == "nccl":
                self.pg = dist.ProcessGroupNCCL(self._store, rank, world_size)
            else:
                self.pg = dist.ProcessGroupGloo(self._store, rank, world_size, self.timeout)
        except (RuntimeError, ValueError) as e:
            if probe is not None:
                shm_files.unlink(probe)
            raise self._join_error(address, rank, world_size, e) from e
        self.rank = rank
        if self.backend == "gloo":
            try:
                self._settle_shm(rank, world_size, probe)
            except (RuntimeError, ValueError) as e:  # a member gone before it answered
                raise self._join_error(address, rank, world_size, e) from e

    def _settle_shm(self, rank: int, world_size: int, probe: str | None) -> None:
        """After the group formed: each receiver says whether it reads rank 0's probe
        (it shares this /dev/shm: one machine, one IPC namespace); rank 0 sends
        shared-memory buckets only if all do. Receivers of a rank 0 that did not ask
        answer nothing; every receiver follows what each handle says."""
        if rank != 0:
            shm_files.answer_probe(self._store, rank)
            return
        if probe is None:
            return
        try:
            keys = [shm_files.SEEN_KEY.format(r) for r in range(1, world_size)]
            self._store.wait(keys, self.timeout)
            self.shm = all(self._store.get(k) == b"1" for k in keys)
        finally:
            shm_files.unlink(probe)

    def _join_error(
        self, address: str, rank: int, world_size: int, e: BaseException
    ) -> WeightSyncError:
        return WeightSyncError(
            f"rank {rank} could not join the weight broadcast group at {address} "
            f"({world_size} ranks, {self.backend}): {e}"
        )

    def _require_group(self) -> None:
        if self.pg is None:
            raise WeightSyncError(
                "the collective transport has no group yet: call "
                "join_group on the learner and every engine first"
            )

    def send(
        self,
        weights: dict[str, torch.Tensor],
        version: int,
        seen: dict[str, str] | None = None,
    ) -> WeightHandle:
        self._require_group()
        if self._thread is not None:
            raise WeightSyncError(
                f"push of policy_version {version} started before the "
                "previous push finished (call finish first; a broadcast still running "
                "after finish's timeout blocks every later push)"
            )
        layout = self._layout(weights)
        handle = WeightHandle(
            version=version,
            payload=layout,
            num_bytes=sum(b["size"] for b in layout),
            names=tuple(weights),
        )
        self._error = None
        self._thread = threading.Thread(
            target=self._broadcast_all,
            args=(weights, layout, seen),
            name=f"weight-broadcast-v{version}",
            daemon=True,
        )
        self._thread.start()
        return handle

    def _broadcast_all(
        self, weights: dict[str, torch.Tensor], layout: list[dict], seen: dict[str, str] | None
    ) -> None:
        try:
            self._broadcast_buckets(iter(weights.items()), layout, seen)
        except (RuntimeError, ValueError) as e:
            self._error = e

    def _broadcast_buckets(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        layout: list[dict],
        seen: dict[str, str] | None = None,
    ) -> None:
        # Two buckets in flight: pack bucket i+1 while bucket i is on the wire. With
        # `seen`, each tensor is fingerprinted as it is packed (weightsync/verify.py).
        pending, delivered = None, False
        try:
            for i, bucket in enumerate(layout):
                pending = self._send_bucket(i, bucket, stream, seen, pending)
            if pending is not None:
                pending.wait()
            delivered = True
        finally:
            self._files.settle(delivered)

    def _send_bucket(
        self,
        i: int,
        bucket: dict,
        stream: Iterator[tuple[str, torch.Tensor]],
        seen: dict[str, str] | None,
        pending,
    ):
        """Pack bucket `i` and start its broadcast: its bytes over gloo / NCCL, or with
        shared memory a one-number signal that it is written. Waits for `pending`,
        bucket i-1's broadcast; returns this one's."""
        shm = "shm" in bucket
        buf = self._files.out[i][1] if shm else self._buffer("send", i, bucket["size"])
        buf = buf[: bucket["size"]]
        for name, _, _, offset, nbytes in bucket["entries"]:
            got, t = next(stream)
            if got != name:
                raise ValueError(f"streamed tensor {got!r} where the layout has {name!r}")
            if seen is not None:
                seen[name] = copy_fingerprint(buf[offset : offset + nbytes], t)
            else:
                buf[offset : offset + nbytes].copy_(
                    t.detach().contiguous().view(-1).view(torch.uint8)
                )
        work = self.pg.broadcast(torch.tensor([i]) if shm else buf, 0)
        if pending is not None:
            pending.wait()
        return work

    def _layout(self, weights) -> list[dict]:
        """`bucket_layout` of `weights` (tensors or their `tensor_meta`), each bucket
        given its /dev/shm file when the group shares one (weightsync/shm.py)."""
        layout = bucket_layout(weights, self.bucket_bytes)
        return self._files.assign(layout) if self.shm else layout

    def stream_handle(
        self, meta: list[tuple[str, str, tuple[int, ...]]], version: int
    ) -> WeightHandle:
        layout = self._layout(meta)
        return WeightHandle(
            version=version,
            payload=layout,
            num_bytes=sum(b["size"] for b in layout),
            names=tuple(m[0] for m in meta),
        )

    def send_stream(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        handle: WeightHandle,
        seen: dict[str, str] | None = None,
    ) -> None:
        # Bucket by bucket as the tensors are produced; engines run `receive` meanwhile.
        self._require_group()
        try:
            self._broadcast_buckets(stream, handle.payload, seen)
        except (RuntimeError, ValueError, StopIteration) as e:
            raise WeightSyncError(
                f"streamed broadcast of policy_version {handle.version} failed: {e}"
            ) from e

    def finish(self, handle: WeightHandle) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join(self.timeout.total_seconds() + 10)
        if thread.is_alive():
            # Kept: its broadcast may still read the kept buffers, so no push may start.
            self._thread = thread
            raise WeightSyncError(
                f"broadcast of policy_version {handle.version} still running "
                f"after {self.timeout.total_seconds():.0f} s"
            )
        if self._error is not None:
            raise WeightSyncError(
                f"broadcast of policy_version {handle.version} failed: {self._error}"
            ) from self._error

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_group()
        layout = handle.payload

        mapped = self._files.map(layout, handle.version)

        def post(i: int):
            if "shm" in layout[i]:  # the sender writes the bucket, then signals it
                return self.pg.broadcast(torch.empty(1, dtype=torch.int64), 0), mapped[i]
            buf = self._buffer("recv", i, layout[i]["size"])
            return self.pg.broadcast(buf, 0), buf

        # Bucket i+1 is received while the engine loads bucket i's tensors.
        nxt = post(0) if layout else None
        for i, bucket in enumerate(layout):
            work, buf = nxt
            try:
                work.wait()
                nxt = post(i + 1) if i + 1 < len(layout) else None
            except RuntimeError as e:
                raise WeightSyncError(
                    f"broadcast of policy_version {handle.version} failed at bucket "
                    f"{i + 1}/{len(layout)}: {e}"
                ) from e
            for name, dtype, shape, offset, nbytes in bucket["entries"]:
                yield name, buf[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)

    def close(self) -> None:
        self._files.close()
        self.pg, self._store, self._kept = None, None, {}
