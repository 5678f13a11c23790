"""Saving the policy: the full model in `save_pretrained` format, or with an adapter
the adapter in PEFT format (`adapter_config.json`, `adapter_model.safetensors`;
`PeftModel.from_pretrained(base, path)` loads it) plus, with `adapter.save_merged`, the
merged model in `path/merged`. Every folder also gets the source model's tokenizer
files and `generation_config.json` verbatim (learner/export.py), so a saved policy
stops on the same EOS ids and keeps its sampling defaults.

Collective: every learner rank calls `save_policy`; rank 0 writes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.learner import adapters
from posttrain.learner.adapters import AdapterSettings
from posttrain.learner.export import carry_model_files
from posttrain.learner.push import full_state_dict


def save_policy(policy: torch.nn.Module, rank: int, model_path: str, adapter: AdapterSettings,
                path: str) -> str | None:
    """Save `policy` into `path` (see the module docstring); returns `path` on rank 0,
    None elsewhere."""
    folders = []
    if adapter.enabled:
        _save_adapter(policy, rank, model_path, adapter, Path(path))
        folders.append(Path(path))
    if not adapter.enabled or adapter.save_merged:
        full = Path(path) / "merged" if adapter.enabled else Path(path)
        _save_full(policy, rank, model_path, adapter, full)
        folders.append(full)
    if rank != 0:
        return None
    for folder in folders:
        carry_model_files(model_path, folder)
    return path


def _save_full(policy: torch.nn.Module, rank: int, model_path: str, adapter: AdapterSettings,
               path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    full = full_state_dict(policy, rank, model_path, adapter)
    if rank != 0:
        return
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(full, assign=True, strict=False)
    plain.tie_weights()
    path.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(path)


def _save_adapter(policy: torch.nn.Module, rank: int, model_path: str,
                  adapter: AdapterSettings, path: Path) -> None:
    from safetensors.torch import save_file

    full = adapters.gather_params(policy, adapter_only=True, keep=rank == 0)
    if rank != 0:
        return
    state = adapters.peft_adapter_state(policy, full)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()},
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapters.lora_config(adapter, model_path).save_pretrained(str(path))
