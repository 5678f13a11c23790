"""Shared-memory buckets of the collective transport (`weight_sync.shm_broadcast`, gloo
on one machine; weightsync/collective.py's "Shared memory"): the probe that tells
whether every receiver shares rank 0's /dev/shm, and the bucket files of a push, made
by the sender, mapped by each receiver before it joins the first broadcast, unlinked
once the push is delivered."""

from __future__ import annotations

import contextlib
import os
import uuid

import torch

from .base import WeightSyncError

#: Rank 0's probe file in /dev/shm (path and content), and each receiver's answer.
PROBE_KEY = "posttrain/shm_probe"
SEEN_KEY = "posttrain/shm_seen/{}"
SHM_DIR = "/dev/shm"


def unlink(path: str) -> None:
    """Remove a /dev/shm file of ours; one already gone is not an error (a cleanup must
    not hide the error that led to it)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def make_probe(store) -> str | None:
    """Rank 0: a small file in /dev/shm that receivers must read back to be sent
    shared-memory buckets; its path and content go in `store` (a `TCPStore`) before the
    group forms (None: no /dev/shm here)."""
    if not os.path.isdir(SHM_DIR):
        return None
    token = uuid.uuid4().hex
    path = os.path.join(SHM_DIR, f"posttrain-probe-{token}")
    with open(path, "w") as f:
        f.write(token)
    store.set(PROBE_KEY, f"{path}|{token}")
    return path


def answer_probe(store, rank: int) -> None:
    """Receiver `rank`: say in `store` whether it reads rank 0's probe (it shares this
    /dev/shm: one machine, one IPC namespace); nothing if rank 0 did not ask."""
    if not store.check([PROBE_KEY]):
        return
    path, _, token = store.get(PROBE_KEY).decode().partition("|")
    try:
        with open(path) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    store.set(SEEN_KEY.format(rank), "1" if seen else "0")


class ShmBuckets:
    """The /dev/shm files of one transport's pushes.

    Attributes:
        out: sender, bucket index -> (file, its mapping), kept from push to push.
        new: sender, the files made for the push in flight (unlinked when it settles).
        mapped: receiver, file -> its mapping, kept while pushes name the file.
    """

    def __init__(self) -> None:
        self.out: dict[int, tuple[str, torch.Tensor]] = {}
        self.new: list[str] = []
        self.mapped: dict[str, torch.Tensor] = {}

    def assign(self, layout: list[dict]) -> list[dict]:
        """Sender: give each bucket its /dev/shm file (`"shm"`: its path, `"shm_bytes"`:
        the file's size), kept from push to push while the bucket fits (a delta push's
        buckets are smaller than the first, full push's); otherwise a new file under a
        new name, so no receiver can take a stale mapping for it."""
        for i, bucket in enumerate(layout):
            kept = self.out.get(i)
            if kept is None or kept[1].numel() < bucket["size"]:
                path = os.path.join(SHM_DIR, f"posttrain-push-{uuid.uuid4().hex}-{i}")
                buf = torch.from_file(path, shared=True, size=bucket["size"], dtype=torch.uint8)
                self.out[i] = (path, buf)
                self.new.append(path)
            bucket["shm"] = self.out[i][0]
            bucket["shm_bytes"] = self.out[i][1].numel()
        return layout

    def settle(self, delivered: bool) -> None:
        """Sender: unlink the files made for this push: every receiver mapped them before
        it joined the first broadcast, so the mappings outlive the names and nothing is
        left in /dev/shm. A failed push also forgets them (a receiver may not have mapped
        one): the next push makes new files."""
        for path in self.new:
            unlink(path)
        if not delivered:
            gone = set(self.new)
            self.out = {i: v for i, v in self.out.items() if v[0] not in gone}
        self.new = []

    def map(self, layout: list[dict], version: int) -> dict[int, torch.Tensor]:
        """Receiver: map the push's bucket files (before joining its first broadcast, so
        the sender may unlink them once that broadcast is done); mappings of files no
        longer in use are dropped. Returns bucket index -> its bytes (uint8, 1-D).

        Raises:
            WeightSyncError: a file cannot be opened (this process does not share the
                sender's /dev/shm, or the file went with a failed push).
        """
        paths = {i: b["shm"] for i, b in enumerate(layout) if "shm" in b}
        self.mapped = {p: t for p, t in self.mapped.items() if p in paths.values()}
        for i, path in paths.items():
            if path not in self.mapped:
                if not os.path.exists(path):
                    raise WeightSyncError(
                        f"policy_version {version}: the shared-memory bucket {path} is not "
                        "there; set weight_sync.shm_broadcast: false if engines and learner "
                        "rank 0 do not share /dev/shm"
                    )
                self.mapped[path] = torch.from_file(
                    path, shared=True, size=layout[i]["shm_bytes"], dtype=torch.uint8
                )
        return {i: self.mapped[p][: layout[i]["size"]] for i, p in paths.items()}

    def close(self) -> None:
        """Unlink the files of a push not settled, and drop every mapping."""
        for path in self.new:
            unlink(path)
        self.out, self.new, self.mapped = {}, [], {}
