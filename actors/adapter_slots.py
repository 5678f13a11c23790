"""Named LoRA adapters on one engine: many adapters (the service's sessions) beside one
base model, each sampled by name.

Structure: `AdapterSlots` is the engine-independent bookkeeping, a least-recently-used
table of `max_adapters` slots (name → the version it holds and the engine's own handle
for it); `NamedAdapters` is the interface an engine implements to serve them (`engine:
hf` through peft's named adapters, actors/hf_adapters.py; `engine: vllm` through one
`LoRARequest` per adapter, actors/vllm_adapters.py). The rollout worker loads a push
whose `meta["adapter_name"]` is set under that name (`RolloutWorker.update_weights`)
and samples with it on `generate_ids(..., adapter=name)`.

Eviction: loading a new name into full slots first releases the least recently used
adapter (loaded or sampled longest ago); a later request for it is a ValueError that
names it as evicted (the service pushes it again). Replacing a name's adapter releases
the old one first, so an engine never holds more than `max_adapters`.

Limits: an engine serves either the recipe's single adapter (adapter-only weight sync,
`InferenceEngine.load_adapter`) or named adapters, never both (refused with a
ValueError); the asynchronous vLLM engine serves no named adapters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .engine import Sample
from .rollout import SamplingSettings


def lora_config_kwargs(config: dict) -> dict[str, Any]:
    """The keys of a pushed `peft.LoraConfig` dict that `LoraConfig` takes (a dict from
    `to_dict()` also carries read-only and derived fields), in inference mode."""
    from peft import LoraConfig

    fields = LoraConfig.__dataclass_fields__
    return {**{k: v for k, v in config.items() if k in fields}, "inference_mode": True}


class AdapterNotHeld(ValueError):
    """A named adapter this engine does not hold (never loaded, dropped or evicted):
    the caller may push it again."""


@dataclass(frozen=True)
class Slot:
    """One named adapter an engine holds.

    Attributes:
        name: the caller's name (a service session id).
        version: the policy_version (sampler-weights version) of the adapter loaded.
        key: the engine's handle for it (a peft adapter name, a vLLM `LoRARequest`).
    """

    name: str
    version: int
    key: Any


class AdapterSlots:
    """Least-recently-used table of the named adapters one engine holds.

    Args:
        capacity: the most adapters held at once (`EngineSettings.max_adapters`).

    Raises:
        ValueError: `capacity` < 1.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"rollout max_adapters must be at least 1, got {capacity}")
        self.capacity = capacity
        self._slots: OrderedDict[str, Slot] = OrderedDict()  # oldest use first
        self._evicted: set[str] = set()
        self._ids = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def names(self) -> list[str]:
        """Names held, least recently used first."""
        return list(self._slots)

    def new_id(self) -> int:
        """A number never handed out before by this table (1, 2, ...): engine handles
        (vLLM's `lora_int_id`, a folder, a peft adapter name) are never reused."""
        self._ids += 1
        return self._ids

    def peek(self, name: str) -> Slot | None:
        """The slot of `name` without counting a use; None if not held."""
        return self._slots.get(name)

    def use(self, name: str) -> Slot:
        """The slot of `name`, now the most recently used.

        Raises:
            AdapterNotHeld: `name` is not held (never loaded, dropped, or evicted: said so).
        """
        slot = self._slots.get(name)
        if slot is None:
            why = (
                f"was evicted (the engine holds {self.capacity} adapters, "
                "rollout max_adapters); push it again"
                if name in self._evicted
                else "is not loaded on this engine; push its weights first"
            )
            raise AdapterNotHeld(f"LoRA adapter {name!r} {why}")
        self._slots.move_to_end(name)
        return slot

    def make_room(self, name: str) -> list[Slot]:
        """Take out the slots that loading `name` releases: its old version, and the least
        recently used adapter when the table is full; the caller frees them in the
        engine before loading."""
        out = [self._slots.pop(name)] if name in self._slots else []
        while len(self._slots) >= self.capacity:
            _, old = self._slots.popitem(last=False)
            self._evicted.add(old.name)
            out.append(old)
        return out

    def put(self, name: str, version: int, key: Any) -> Slot:
        """Record `name` as loaded (most recently used); call after `make_room`."""
        slot = Slot(name, version, key)
        self._slots[name] = slot
        self._evicted.discard(name)
        return slot

    def pop(self, name: str) -> Slot | None:
        """Take `name` out (dropped, not evicted: a later use says it is not loaded)."""
        self._evicted.discard(name)
        return self._slots.pop(name, None)


class NamedAdapters(ABC):
    """What an engine implements to serve named LoRA adapters. Used by one thread at
    a time (the worker's engine lock), as the rest of the engine."""

    #: the named adapters held; set in the engine's constructor.
    slots: AdapterSlots

    @abstractmethod
    def load_named_adapter(
        self, name: str, weights: Iterable[tuple[str, torch.Tensor]], config: dict, version: int
    ) -> list[str]:
        """Hold this adapter under `name` (replacing that name's older one, evicting the
        least recently used adapter when the slots are full); returns the tensor names.

        Args:
            name: the adapter's name.
            weights: PEFT-format tensors (`...q_proj.lora_A.weight` `[r, in]`,
                `...lora_B.weight` `[out, r]`).
            config: its `peft.LoraConfig` as a plain dict (r, lora_alpha, targets).
            version: its version (returned by `named_adapter_version`).

        Raises:
            ValueError: it does not fit the engine (rank, modules, tensor names), or the
                engine serves the recipe's single adapter.
        """

    @abstractmethod
    def generate_named(
        self, prompts: list[list[int]], sampling: SamplingSettings, name: str
    ) -> list[list[Sample]]:
        """`generate` with base + adapter `name` (counts as a use).

        Raises:
            ValueError: `name` is not held (unknown, dropped or evicted).
        """

    @abstractmethod
    def drop_named_adapter(self, name: str) -> bool:
        """Release `name`'s adapter; False when it was not held."""

    @abstractmethod
    def held_named_tensors(self, name: str, names: Iterable[str]) -> dict[str, torch.Tensor] | None:
        """The tensors adapter `name` holds under the pushed PEFT `names`, for the proof
        of delivery; None when the engine keeps no plain copy (vLLM)."""

    def named_adapter_version(self, name: str) -> int | None:
        """The version of `name`'s adapter a `generate_named` request runs with now;
        None when it is not held."""
        slot = self.slots.peek(name)
        return None if slot is None else slot.version
