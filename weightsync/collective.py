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

import contextlib
import math
import os
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta

import torch

from .base import WeightHandle, WeightSyncError, WeightTransport
from .verify import copy_fingerprint

_MiB = 1 << 20
_ALIGN = 64  # bytes
#: Counter in the rendezvous store: how many members have joined through it.
_JOINS_KEY = "posttrain/push_group_joins"
#: Rank 0's probe file in /dev/shm (path and content), and each receiver's answer.
_PROBE_KEY = "posttrain/shm_probe"
_SEEN_KEY = "posttrain/shm_seen/{}"
_SHM_DIR = "/dev/shm"


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


def _unlink(path: str) -> None:
    """Remove a /dev/shm file of ours; one already gone is not an error (a cleanup must
    not hide the error that led to it)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


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
        self._shm_out: dict[int, tuple[str, torch.Tensor]] = {}  # sender: index -> file, buffer
        self._shm_in: dict[str, torch.Tensor] = {}  # receiver: file -> its mapping
        self._shm_new: list[str] = []  # sender: files made for the push in flight

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
        probe = self._make_probe() if rank == 0 and self.shm_asked else None
        try:
            if self.backend == "nccl":
                self.pg = dist.ProcessGroupNCCL(self._store, rank, world_size)
            else:
                self.pg = dist.ProcessGroupGloo(self._store, rank, world_size, self.timeout)
        except (RuntimeError, ValueError) as e:
            if probe is not None:
                _unlink(probe)
            raise self._join_error(address, rank, world_size, e) from e
        self.rank = rank
        if self.backend == "gloo":
            try:
                self._settle_shm(rank, world_size, probe)
            except (RuntimeError, ValueError) as e:  # a member gone before it answered
                raise self._join_error(address, rank, world_size, e) from e

    def _make_probe(self) -> str | None:
        """Rank 0: a small file in /dev/shm that receivers must read back to be sent
        shared-memory buckets; its path and content go in the store before the group
        forms (None: no /dev/shm here)."""
        if not os.path.isdir(_SHM_DIR):
            return None
        token = uuid.uuid4().hex
        path = os.path.join(_SHM_DIR, f"posttrain-probe-{token}")
        with open(path, "w") as f:
            f.write(token)
        self._store.set(_PROBE_KEY, f"{path}|{token}")
        return path

    def _settle_shm(self, rank: int, world_size: int, probe: str | None) -> None:
        """After the group formed: each receiver says whether it reads rank 0's probe
        (it shares this /dev/shm: one machine, one IPC namespace); rank 0 sends
        shared-memory buckets only if all do. Receivers of a rank 0 that did not ask
        answer nothing; every receiver follows what each handle says."""
        if rank != 0:
            if not self._store.check([_PROBE_KEY]):
                return
            path, _, token = self._store.get(_PROBE_KEY).decode().partition("|")
            try:
                with open(path) as f:
                    seen = f.read() == token
            except OSError:
                seen = False
            self._store.set(_SEEN_KEY.format(rank), "1" if seen else "0")
            return
        if probe is None:
            return
        try:
            keys = [_SEEN_KEY.format(r) for r in range(1, world_size)]
            self._store.wait(keys, self.timeout)
            self.shm = all(self._store.get(k) == b"1" for k in keys)
        finally:
            _unlink(probe)

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
        layout = self._shm_assign(bucket_layout(weights, self.bucket_bytes))
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
            self._shm_settle(delivered)

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
        buf = self._shm_out[i][1] if shm else self._buffer("send", i, bucket["size"])
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

    def _shm_assign(self, layout: list[dict]) -> list[dict]:
        """Sender with shared memory: give each bucket its /dev/shm file (`"shm"`: its
        path, `"shm_bytes"`: the file's size), kept from push to push while the bucket
        fits (a delta push's buckets are smaller than the first, full push's); otherwise
        a new file under a new name, so no receiver can take a stale mapping for it."""
        if not self.shm:
            return layout
        for i, bucket in enumerate(layout):
            kept = self._shm_out.get(i)
            if kept is None or kept[1].numel() < bucket["size"]:
                path = os.path.join(_SHM_DIR, f"posttrain-push-{uuid.uuid4().hex}-{i}")
                buf = torch.from_file(path, shared=True, size=bucket["size"], dtype=torch.uint8)
                self._shm_out[i] = (path, buf)
                self._shm_new.append(path)
            bucket["shm"] = self._shm_out[i][0]
            bucket["shm_bytes"] = self._shm_out[i][1].numel()
        return layout

    def _shm_settle(self, delivered: bool) -> None:
        """Unlink the files made for this push: every receiver mapped them before it
        joined the first broadcast, so the mappings outlive the names and nothing is
        left in /dev/shm. A failed push also forgets them (a receiver may not have
        mapped one): the next push makes new files."""
        for path in self._shm_new:
            _unlink(path)
        if not delivered:
            gone = set(self._shm_new)
            self._shm_out = {i: v for i, v in self._shm_out.items() if v[0] not in gone}
        self._shm_new = []

    def stream_handle(
        self, meta: list[tuple[str, str, tuple[int, ...]]], version: int
    ) -> WeightHandle:
        layout = self._shm_assign(bucket_layout(meta, self.bucket_bytes))
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

        mapped = self._shm_map(layout, handle.version)

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

    def _shm_map(self, layout: list[dict], version: int) -> dict[int, torch.Tensor]:
        """Receiver: map the push's shared-memory bucket files (before joining its
        first broadcast, so the sender may unlink them once that broadcast is done);
        mappings of files no longer in use are dropped.

        Raises:
            WeightSyncError: a file cannot be opened (this process does not share the
                sender's /dev/shm, or the file went with a failed push).
        """
        paths = {i: b["shm"] for i, b in enumerate(layout) if "shm" in b}
        self._shm_in = {p: t for p, t in self._shm_in.items() if p in paths.values()}
        for i, path in paths.items():
            if path not in self._shm_in:
                if not os.path.exists(path):
                    raise WeightSyncError(
                        f"policy_version {version}: the shared-memory bucket {path} is not "
                        "there; set weight_sync.shm_broadcast: false if engines and learner "
                        "rank 0 do not share /dev/shm"
                    )
                self._shm_in[path] = torch.from_file(
                    path, shared=True, size=layout[i]["shm_bytes"], dtype=torch.uint8
                )
        return {i: self._shm_in[p][: layout[i]["size"]] for i, p in paths.items()}

    def close(self) -> None:
        for path in self._shm_new:
            _unlink(path)
        self._shm_new, self._shm_out, self._shm_in = [], {}, {}
        self.pg, self._store, self._kept = None, None, {}
