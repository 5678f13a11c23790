"""Named LoRA adapters on `engine: vllm` (actors/adapter_slots.py): each adapter is a
PEFT folder in /dev/shm registered as a vLLM `LoRARequest` of its own, and a request by
name passes that `LoRARequest`.

vLLM holds up to `max_loras` adapters in a batch and `max_cpu_loras` in host memory;
both are `max_adapters` (`vllm_lora_options`), so vLLM never evicts one on its own:
`AdapterSlots` picks the least recently used and this module removes it from vLLM.

Every load gets a new `lora_int_id` and folder (`AdapterSlots.new_id`), and the
request's `lora_name` carries that id: vLLM keys its prefix cache by the LoRA's name
and path, so KV blocks computed under an adapter's older version are never served to
its newer one, and the other adapters keep their cached blocks (no cache reset).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .adapter_slots import AdapterSlots, NamedAdapters, Slot
from .engine import Sample
from .rollout import SamplingSettings


class VLLMNamedAdapters(NamedAdapters):
    """Mixin of `VLLMEngine`, which sets `llm`, `lora` (the recipe's adapter), `slots`
    and `_named_root`."""

    llm: Any
    lora: Any
    slots: AdapterSlots
    _named_root: Path | None

    def load_named_adapter(
        self, name: str, weights: Iterable[tuple[str, torch.Tensor]], config: dict, version: int
    ) -> list[str]:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        lora_config = self.llm.llm_engine.vllm_config.lora_config
        if lora_config is None:
            raise ValueError(
                f"named adapter {name!r}: this engine was started without LoRA; give it a "
                "lora_rank (the largest adapter rank it serves)"
            )
        if self.lora is not None:
            raise ValueError(
                "this engine serves the recipe's adapter (adapter-only weight sync); named "
                f"adapter {name!r} needs an engine of its own"
            )
        rank = int(config.get("r", 0))
        if rank > lora_config.max_lora_rank:
            raise ValueError(
                f"named adapter {name!r} has rank {rank}; this engine serves ranks up to "
                f"{lora_config.max_lora_rank} (its lora_rank)"
            )
        tensors = {n: t.detach().contiguous().clone() for n, t in weights}
        for old in self.slots.make_room(name):
            self._release(old)
        key = self.slots.new_id()
        folder = self._named_folder() / str(key)
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config))
        request = LoRARequest(f"named-{key}", key, str(folder))
        try:
            added = self.llm.llm_engine.add_lora(request)
        except (ValueError, RuntimeError, KeyError) as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(f"vLLM refused named adapter {name!r}: {e}") from e
        if not added:
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(f"vLLM did not load named adapter {name!r}")
        self.slots.put(name, version, request)
        return list(tensors)

    def generate_named(
        self, prompts: list[list[int]], sampling: SamplingSettings, name: str
    ) -> list[list[Sample]]:
        """`generate` with `name`'s `LoRARequest` in place of the recipe's (restored
        after; the engine is used by one thread at a time)."""
        slot = self.slots.use(name)
        recipe, self.lora = self.lora, slot.key
        try:
            return self.generate(prompts, sampling)  # type: ignore[attr-defined]
        finally:
            self.lora = recipe

    def drop_named_adapter(self, name: str) -> bool:
        slot = self.slots.pop(name)
        if slot is not None:
            self._release(slot)
        return slot is not None

    def held_named_tensors(self, name: str, names: Iterable[str]) -> None:
        """None: vLLM keeps no plain copy of an adapter (the proof fingerprints what it
        was handed)."""
        return None

    def named_adapter_version(self, name: str) -> int | None:
        """The version of `name`'s adapter while vLLM still has it registered."""
        slot = self.slots.peek(name)
        if slot is None or slot.key.lora_int_id not in self.llm.llm_engine.list_loras():
            return None
        return slot.version

    def _release(self, slot: Slot) -> None:
        """Remove `slot`'s adapter from vLLM and its folder from /dev/shm."""
        self.llm.llm_engine.remove_lora(slot.key.lora_int_id)
        shutil.rmtree(slot.key.lora_path, ignore_errors=True)

    def _named_folder(self) -> Path:
        """The folder of this engine's named adapters, made at the first one (an engine
        killed by Ray leaves it behind; `close` removes it)."""
        if self._named_root is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._named_root = Path(tempfile.mkdtemp(prefix="posttrain-named-lora-", dir=shm))
        return self._named_root

    def close(self) -> None:
        """Remove the named adapters' folder, then what the engine releases."""
        if self._named_root is not None:
            shutil.rmtree(self._named_root, ignore_errors=True)
            self._named_root = None
        super().close()  # type: ignore[misc]
