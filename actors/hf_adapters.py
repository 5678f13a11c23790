"""Named LoRA adapters on `engine: hf` (actors/adapter_slots.py): peft's named
adapters on the one model, each under a slot key of its own (`slot1`, `slot2`, ...: a
caller's name may hold characters peft's module dicts refuse, such as '.').

Between calls the adapter layers are switched off, so plain `generate` samples the base
model; `generate_named` switches on the one adapter asked for, samples, and switches
them off again. Each adapter keeps its own `LoraConfig` (rank, alpha, targets).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .adapter_slots import AdapterSlots, NamedAdapters, Slot, lora_config_kwargs
from .engine import Sample
from .rollout import SamplingSettings


class HFNamedAdapters(NamedAdapters):
    """Mixin of `HFEngine` (which sets `model`, `slots` and `adapter_version`)."""

    model: Any
    slots: AdapterSlots
    adapter_version: int | None

    @torch.no_grad()
    def load_named_adapter(
        self, name: str, weights: Iterable[tuple[str, torch.Tensor]], config: dict, version: int
    ) -> list[str]:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        if self.adapter_version is not None:
            raise ValueError(
                "this engine serves the recipe's adapter (adapter-only weight sync); named "
                f"adapter {name!r} needs an engine of its own"
            )
        tensors = {n: t.detach().clone() for n, t in weights}
        cfg = LoraConfig(**lora_config_kwargs(config))
        for old in self.slots.make_room(name):
            self._release(old)
        key = f"slot{self.slots.new_id()}"
        # the adapter in the engine's dtype, as sent: peft would upcast it to float32,
        # so the engine would hold (and compute with) other bytes than the learner sent
        if not hasattr(self.model, "peft_config"):
            self.model = get_peft_model(
                self.model, cfg, adapter_name=key, autocast_adapter_dtype=False
            ).eval()
        else:
            self.model.add_adapter(key, cfg, autocast_adapter_dtype=False)
        result = set_peft_model_state_dict(self.model, tensors, adapter_name=key)
        # peft initialises lora_A at random: a tensor not sent would sample noise
        unsent = [k for k in result.missing_keys if f".{key}." in k and "lora_" in k]
        if result.unexpected_keys or unsent:
            self.model.delete_adapter(key)
            self._layers_off()
            bad = result.unexpected_keys[:3] or unsent[:3]
            raise ValueError(
                f"LoRA adapter {name!r}: tensors {bad} "
                + ("do not fit the rollout model" if result.unexpected_keys else "were not sent")
            )
        self.slots.put(name, version, key)
        self._layers_off()
        return list(tensors)

    def generate_named(
        self, prompts: list[list[int]], sampling: SamplingSettings, name: str
    ) -> list[list[Sample]]:
        slot = self.slots.use(name)
        self.model.base_model.enable_adapter_layers()
        self.model.set_adapter(slot.key)
        try:
            return self.generate(prompts, sampling)
        finally:
            self._layers_off()

    def drop_named_adapter(self, name: str) -> bool:
        slot = self.slots.pop(name)
        if slot is not None:
            self._release(slot)
        return slot is not None

    def held_named_tensors(self, name: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        slot = self.slots.peek(name)
        if slot is None:
            return {}
        held = get_peft_model_state_dict(self.model, adapter_name=slot.key)
        return {n: held[n] for n in names if n in held}

    def _release(self, slot: Slot) -> None:
        """Delete `slot`'s peft adapter (its tensors are freed)."""
        self.model.delete_adapter(slot.key)

    def _layers_off(self) -> None:
        """Every adapter layer off: the model samples as the base until the next
        `generate_named`."""
        self.model.base_model.disable_adapter_layers()
