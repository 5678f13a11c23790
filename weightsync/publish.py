"""The order of one weight push, in one place: `publish` (each learner rank) and
`push` (the controller), plus the rendezvous store of a push group.

One push of policy_version v:
  1. every learner rank runs `publish_weights(v)`, a Ray streaming generator over
     `publish`: rank 0 yields the `WeightHandle` as soon as it exists (at once for a
     streamed push, after the gather otherwise), then delivers, then ends;
  2. `push` hands rank 0's handle to every rollout worker's `update_weights` and waits
     at most `timeout_s` for each to acknowledge version v;
  3. `push` then waits for every learner rank's generator to end (a broadcast thread
     joined, a streamed broadcast finished), surfacing its errors.
Streamed or gathered is rank 0's choice here: streamed when the transport can stream,
the layout is known before gathering and no checksum is asked (a checksum needs every
tensor before the handle leaves).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from .base import PushSource, WeightHandle, WeightSyncError, WeightTransport


def publish(
    transport: WeightTransport,
    source: PushSource,
    version: int,
    *,
    sender: bool,
    checksum: bool = False,
) -> Iterator[WeightHandle | None]:
    """Learner side of one push: yields the handle (None on ranks other than the
    sender), then returns once the push is delivered on the sender's side.

    Every learner rank must run it to the end at the same time: producing the tensors
    is a collective over the learner group.

    Raises:
        WeightSyncError: delivery failed or timed out (from the transport).
    """
    if transport.can_stream and source.layout is not None and not checksum:
        handle = transport.stream_handle(source.layout, version) if sender else None
        yield handle  # engines start receiving while the tensors are gathered
        if sender:
            transport.send_stream(source.tensors, handle)
        else:
            for _ in source.tensors:  # the all-gathers need every rank
                pass
        return
    weights = dict(source.tensors)
    if transport.every_rank_sends:  # a collective send; rank 0's handle goes out
        handle = transport.send(weights, version, checksum=checksum and sender)
        yield handle if sender else None
        transport.finish(handle)
        return
    if not sender:
        yield None
        return
    handle = transport.send(weights, version, checksum=checksum)
    if source.meta:
        handle = dataclasses.replace(handle, meta={**handle.meta, **source.meta})
    yield handle
    transport.finish(handle)


def push(
    learners: Sequence[Any],
    engines: Sequence[Any],
    version: int,
    timeout_s: float,
    full: bool = False,
) -> WeightHandle:
    """Controller side of one push: learners publish `version`, every engine applies
    the handle, and all acknowledge within `timeout_s` seconds. Returns rank 0's handle.

    Args:
        learners: learner actors (rank order); `publish_weights(version, full)` is a
            generator method on each.
        engines: rollout worker actors with `update_weights(handle, step)`.
        full: push full weights even under adapter-only sync (QLoRA's base, version 0).

    Raises:
        WeightSyncError: an engine failed to load, died, did not answer in time, or
            reports another version; the message names the engine and the version.
    """
    import ray

    gens = [
        lw.publish_weights.options(num_returns="streaming").remote(version, full) for lw in learners
    ]
    ready, _ = ray.wait([gens[0]], timeout=timeout_s)  # ready: its next item exists
    if not ready:
        raise WeightSyncError(
            f"learner rank 0 did not publish policy_version {version} within {timeout_s:.0f} s"
        )
    handle = ray.get(next(gens[0]))
    pending = {w.update_weights.remote(handle, version - 1): i for i, w in enumerate(engines)}
    done, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    if late:
        raise WeightSyncError(
            f"rollout engines {sorted(pending[r] for r in late)} did not acknowledge "
            f"policy_version {version} within {timeout_s:.0f} s"
        )
    for ref in done:
        try:
            got = ray.get(ref)
        except ray.exceptions.RayActorError as e:  # killed, out of memory, crashed
            raise WeightSyncError(
                f"rollout engine {pending[ref]} died during the push of policy_version "
                f"{version} ({type(e).__name__})"
            ) from e
        if got != version:
            raise WeightSyncError(
                f"rollout engine {pending[ref]} reports policy_version {got} "
                f"after a push of {version}"
            )
    for g in gens:  # the learners' side ends once every engine has it
        for ref in g:
            ray.get(ref)
    return handle


class GroupStore:
    """The rendezvous store of one push group, hosted by the controller: the learner's
    rank 0 joins as rank 0 and engine i as rank i + 1, each as a client of this store
    (so nobody has to know another role's address in advance).

    One group per store: each rank's address stays in it after the group formed, so a
    new group (after a member was replaced) needs a new store; a join beyond
    `world_size` fails at once (`CollectiveTransport.join_group`).

    Args:
        world_size: learner rank 0 plus every engine.
        timeout_s: how long members may take to join, seconds.
    """

    def __init__(self, world_size: int, timeout_s: float = 300.0):
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.store = dist.TCPStore(
            host,
            0,
            None,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        self.address = f"{host}:{self.store.port}"
        self.world_size = world_size

    def close(self) -> None:
        """Stop hosting (the members' groups stay usable)."""
        self.store = None
