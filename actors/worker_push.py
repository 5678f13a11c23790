"""The push side of `RolloutWorker` (actors/worker.py): how a pushed stream is
received, checked and proved (`weightsync.verify`), and the verbs of named LoRA
adapters (actors/adapter_slots.py), the service's sessions on one base model.

Named adapters: a push whose `meta` carries `adapter_name` (and `adapter_config`) is
held under that name beside the base model; `generate_ids(..., adapter=name)` samples
with it, `drop_adapter(name)` releases it, `delivery(name)` is its proof of delivery
(the adapter's name, version, fingerprints and the version a request by that name runs
with now). The worker's `policy_version`, the recipe's single adapter and the delta
receiver's base are untouched by them. An engine serves the recipe's adapter or named
adapters, never both.

Concurrency: as every push, under the worker's `engine_lock` (one at a time); a named
push does not interrupt partial rollouts (the weights they run with do not change).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ..common.telemetry import SpanRecorder
from ..weightsync import (
    Delivery,
    DeltaReceiver,
    FingerprintTap,
    WeightHandle,
    WeightSyncError,
    fingerprints,
)
from .adapter_slots import NamedAdapters
from .engine import InferenceEngine, Sample
from .partial import PushGate
from .rollout import SamplingSettings


class PushReceiving:
    """Mixin of `RolloutWorker`, which sets the attributes below."""

    worker_id: int
    engine: InferenceEngine
    transport: Any
    delta: DeltaReceiver | None
    engine_lock: threading.Lock
    spans: SpanRecorder
    delivered: Delivery  # the last verified push's account
    #: named adapter → its last verified push's `Delivery`
    named_delivered: dict[str, Delivery]
    gate: PushGate | None

    def delivery(self, adapter: str | None = None) -> Delivery:
        """This engine's account of the last verified push (weightsync/verify.py), or
        of named adapter `adapter`'s last one (version -1 when there is none): the
        controller compares it with the learner's before the next generate."""
        return self.delivered if adapter is None else self._named_delivery(adapter)

    def _push_gate(self) -> AbstractContextManager[None]:
        """With partial rollouts, the gate that interrupts a generation in flight."""
        return self.gate.push() if self.gate is not None else nullcontext()

    def _receive(
        self, handle: WeightHandle
    ) -> tuple[Iterable[tuple[str, torch.Tensor]], FingerprintTap | None]:
        """The push's `(name, tensor)` stream as the engine takes it (delta-decoded
        with `weight_sync.delta`, never for a named adapter), and the tap on it that
        fingerprints every tensor with `meta["verify"]` (weightsync/verify.py)."""
        meta = handle.meta
        stream = self.transport.receive(handle)
        if self.delta is not None and "adapter_name" not in meta:
            self.delta.check(meta, handle.version, self.worker_id)
            stream = self.delta.decode(stream, meta, handle.version)
        # What the engine was handed, for engines that keep no plain copy.
        tap = FingerprintTap(stream) if meta.get("verify") else None
        return (tap if tap is not None else stream), tap

    def _account(
        self, version: int, tap: FingerprintTap, loaded: list[str], adapter: bool
    ) -> Delivery:
        """This engine's `Delivery` of `version`: fingerprints of what it holds where
        it keeps the checkpoint layout, else of what it handed to its loader."""
        held = self.engine.held_tensors(loaded, adapter)
        active = self.engine.active_adapter() if adapter else None
        if held is None:
            return Delivery(version, tap.seen, adapter, active, where="loaded")
        return Delivery(version, fingerprints(held.items()), adapter, active, where="holds")

    def _named_engine(self) -> NamedAdapters:
        """The engine, as one that serves named adapters.

        Raises:
            ValueError: it serves none (the asynchronous vLLM engine).
        """
        if not isinstance(self.engine, NamedAdapters):
            raise ValueError(
                f"rollout engine {type(self.engine).__name__} serves no named LoRA adapters; "
                "use engine 'vllm' without async_engine, or 'hf'"
            )
        return self.engine

    def _refuse_recipe_adapter(self) -> None:
        """Refuse the recipe's single adapter on an engine holding named adapters.

        Raises:
            ValueError: names the adapters held.
        """
        if isinstance(self.engine, NamedAdapters) and len(self.engine.slots):
            raise ValueError(
                f"this engine holds named adapters {self.engine.slots.names()[:3]}; the "
                "recipe's adapter needs an engine of its own"
            )

    def _load_named(self, handle: WeightHandle, name: str) -> int:
        """Hold `handle`'s adapter under `name` (call under the engine lock); returns
        `handle.version`. A load that fails leaves no adapter under `name`.

        Raises:
            WeightSyncError: no `adapter_config`, a delta, or the engine refused it;
                names this worker, the adapter and its version.
        """
        meta, v = handle.meta, handle.version
        where = f"rollout worker {self.worker_id}: LoRA adapter {name!r} version {v}"
        if "adapter_config" not in meta or "delta" in meta:
            raise WeightSyncError(
                f"{where}: a named adapter comes whole with its adapter_config "
                "(weight_sync.delta does not apply to it)"
            )
        try:
            engine = self._named_engine()
            stream, tap = self._receive(handle)
            loaded = engine.load_named_adapter(name, stream, meta["adapter_config"], v)
        except (ValueError, RuntimeError) as e:  # WeightSyncError is a RuntimeError
            if isinstance(self.engine, NamedAdapters):
                self.engine.drop_named_adapter(name)  # never sample a half-checked adapter
            raise WeightSyncError(f"{where}: loading failed: {e}") from e
        if tap is not None:
            held = engine.held_named_tensors(name, loaded)
            fps = tap.seen if held is None else fingerprints(held.items())
            at = "loaded" if held is None else "holds"
            active = engine.named_adapter_version(name)
            self.named_delivered[name] = Delivery(v, fps, True, active, name, where=at)
        for gone in set(self.named_delivered) - set(engine.slots.names()):  # evicted
            del self.named_delivered[gone]
        return v

    def _named_delivery(self, name: str) -> Delivery:
        """Named adapter `name`'s last verified push's account, with the version a
        request by that name runs with now; version -1 when there is none."""
        got = self.named_delivered.get(name)
        if got is None:
            return Delivery(-1, adapter=True, adapter_name=name)
        active = self._named_engine().named_adapter_version(name)
        return Delivery(got.version, got.fingerprints, True, active, name, where=got.where)

    def _generate_named(
        self, prompts: list[list[int]], sampling: SamplingSettings, name: str
    ) -> tuple[list[list[Sample]], int]:
        """`generate` with named adapter `name`, and the adapter's version.

        Raises:
            ValueError: the engine serves no named adapters, or `name` is not held
                (unknown, dropped or evicted: the message says which).
        """
        engine = self._named_engine()
        groups = engine.generate_named(prompts, sampling, name)
        version = engine.named_adapter_version(name)
        return groups, -1 if version is None else version

    def drop_adapter(self, name: str) -> bool:
        """Release named adapter `name` on this engine (its memory, its proof of
        delivery); False when it was not held.

        Raises:
            ValueError: the engine serves no named adapters.
        """
        with self.engine_lock:
            self.named_delivered.pop(name, None)
            return self._named_engine().drop_named_adapter(name)

    def adapters(self) -> dict[str, int]:
        """The named adapters held, least recently used first: name → version ({} on
        an engine that serves none)."""
        if not isinstance(self.engine, NamedAdapters):
            return {}
        with self.engine_lock:
            slots = self.engine.slots
            return {n: slot.version for n in slots.names() if (slot := slots.peek(n))}
