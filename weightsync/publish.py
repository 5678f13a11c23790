"""The order of one weight push, in one place: `publish` (each learner rank) and
`push` (the controller), plus the rendezvous store of a push group.

One push of policy_version v:
  1. every learner rank runs `publish_weights(v)`, a Ray streaming generator over
     `publish`: rank 0 yields the `WeightHandle` as soon as it exists (at once for a
     streamed push, after the gather otherwise), then delivers, then ends;
  2. `push` hands rank 0's handle to every rollout worker's `update_weights` and waits
     at most `timeout_s` for each to acknowledge version v;
  3. `push` then waits for every learner rank's generator to end (a broadcast thread
     joined, a streamed broadcast finished), surfacing its errors; with verification
     (`weight_sync.verify_checksum`, weightsync/verify.py) rank 0's generator ends
     with the fingerprints it sent, and `push` compares them with every engine's
     `delivery()` before the next generate.
Streamed or gathered is rank 0's choice here: streamed when the transport can stream,
the layout is known before gathering and no delta is sent (weightsync/delta.py: changed
elements are known only once a tensor is gathered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from .base import PushSource, WeightHandle, WeightSyncError, WeightTransport
from .delta import DeltaSender
from .verify import Delivery, FingerprintTap, check_delivery


def publish(
    transport: WeightTransport,
    source: PushSource,
    version: int,
    *,
    sender: bool,
    verify: bool = False,
    delta: DeltaSender | None = None,
) -> Iterator[WeightHandle | Delivery | None]:
    """Learner side of one push: yields the handle (None on ranks other than the
    sender), then, with `verify`, the sender's `Delivery` (fingerprints of every tensor
    sent) once the push is delivered on the sender's side.

    Every learner rank must run it to the end at the same time: producing the tensors
    is a collective over the learner group.

    Args:
        verify: fingerprint every tensor as it is sent (`weightsync.verify`); the
            controller compares them with each engine's account.
        delta: rank 0's delta encoder (`weightsync.delta`): send only changed elements.

    Raises:
        WeightSyncError: delivery failed or timed out (from the transport).
    """
    # A transport that packs the bytes fingerprints them in its copy (`fingerprints_sent`);
    # a delta's packed tensors are encodings, so the full tensors are tapped instead.
    fused = verify and sender and transport.fingerprints_sent and delta is None
    seen: dict[str, str] | None = {} if fused else None
    extra = {"seen": seen} if fused else {}
    tap = FingerprintTap(source.tensors) if verify and sender and not fused else None
    tensors = tap if tap is not None else source.tensors
    sent = seen if fused else (tap.seen if tap is not None else None)
    streams = transport.can_stream and source.layout is not None and delta is None
    if streams:
        handle = transport.stream_handle(source.layout, version) if sender else None
        if handle is not None and verify:
            handle = dataclasses.replace(handle, meta={**handle.meta, "verify": True})
        yield handle  # engines start receiving while the tensors are gathered
        if sender:
            transport.send_stream(iter(tensors), handle, **extra)
        else:
            for _ in tensors:  # the all-gathers need every rank
                pass
        if sent is not None:
            yield Delivery(version, sent, expected=source.expected)
        return
    weights = dict(tensors)
    if transport.every_rank_sends:  # a collective send; rank 0's handle goes out
        handle = transport.send(weights, version)
        if sender and verify:
            handle = dataclasses.replace(handle, meta={**handle.meta, "verify": True})
        yield handle if sender else None
        transport.finish(handle)
        if sent is not None:
            yield Delivery(version, sent, expected=source.expected)
        return
    if not sender:
        yield None
        return
    meta = dict(source.meta)
    if delta is not None:
        weights, delta_meta = delta.encode(weights, version)
        meta.update(delta_meta or {})
        meta["changed_fraction"] = delta.last.changed_fraction
    if verify:
        meta["verify"] = True
    handle = transport.send(weights, version, **extra)
    if meta:
        handle = dataclasses.replace(handle, meta={**handle.meta, **meta})
    yield handle
    transport.finish(handle)
    if sent is not None:
        adapter, name = "adapter_config" in meta, meta.get("adapter_name")
        yield Delivery(version, sent, adapter=adapter, adapter_name=name, expected=source.expected)


def push(
    learners: Sequence[Any],
    engines: Sequence[Any],
    version: int,
    timeout_s: float,
    full: bool = False,
    fresh: bool = False,
    publisher: Callable[[Any], Any] | None = None,
) -> WeightHandle:
    """Controller side of one push: learners publish `version`, every engine applies
    the handle, and all acknowledge within `timeout_s` seconds. Returns rank 0's handle.

    Args:
        learners: learner actors (rank order); `publish_weights(version, full)` is a
            generator method on each.
        engines: rollout worker actors with `update_weights(handle, step)`.
        full: push full weights even under adapter-only sync (QLoRA's base, version 0).
        fresh: no delta: every engine gets whole tensors (the first push of a run, a
            resume, an engine replacement; `weightsync.delta`).
        publisher: `learner → streaming generator ref` of another publishing verb than
            `publish_weights(version, full, fresh)` (posttrain serve: a session's adapter,
            `publish_session`); the same order and checks apply.

    Raises:
        WeightSyncError: an engine failed to load, died, did not answer in time,
            reports another version, or (with verification, `weightsync.verify`) holds
            a tensor that differs from the learner's or does not serve the pushed
            adapter; the message names the engine, the version and the tensor.
    """
    import ray

    if publisher is None:

        def publisher(lw: Any) -> Any:
            return lw.publish_weights.options(num_returns="streaming").remote(version, full, fresh)

    gens = [publisher(lw) for lw in learners]
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
    sent = None
    for g in gens:  # the learners' side ends once every engine has it
        for ref in g:
            item = ray.get(ref)
            sent = item if isinstance(item, Delivery) else sent
    if sent is not None:  # proof of delivery: every engine's account against the learner's
        # a named adapter (posttrain serve) is accounted for by its name
        name = sent.adapter_name
        asks = [w.delivery.remote(name) if name else w.delivery.remote() for w in engines]
        reports = ray.get(asks, timeout=timeout_s)
        for i, got in enumerate(reports):
            check_delivery(sent, got, i)
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
