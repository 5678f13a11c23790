"""Saving the policy, and the training state a resume needs.

The policy: the full model in `save_pretrained` format, or with an adapter
the adapter in PEFT format (`adapter_config.json`, `adapter_model.safetensors`;
`PeftModel.from_pretrained(base, path)` loads it) plus, with `adapter.save_merged`, the
merged model in `path/merged`. Every folder also gets the source model's tokenizer
files and `generation_config.json` verbatim (learner/export.py), so a saved policy
stops on the same EOS ids and keeps its sampling defaults.

The training state (`save_state` / `load_state`): every (model, optimizer) pair, sharded,
through torch.distributed.checkpoint (`get_state_dict` / `set_state_dict`, `dcp.save` /
`dcp.load`), so it reloads on another number of ranks; plus `rank_R.pt` per rank with the
LR scheduler, the optimizer-step count and the RNGs (torch, python `random`, numpy). A
rank the checkpoint did not have takes rank 0's scheduler and keeps its own seeded RNGs.

Collective: every learner rank calls `save_policy`, `save_state` and `load_state`;
rank 0 writes the full policy, each rank its own shards.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..common.score_head import pooling_pad_id
from . import adapters
from .adapters import AdapterSettings
from .export import carry_model_files, set_pad_token
from .push import full_state_dict


def save_policy(
    policy: torch.nn.Module,
    rank: int,
    model_path: str,
    adapter: AdapterSettings,
    path: str,
    head: str = "lm",
) -> str | None:
    """Save `policy` into `path` (see the module docstring); returns `path` on rank 0,
    None elsewhere. `head='score'` (a reward model) saves a one-label
    `AutoModelForSequenceClassification` folder (e.g. `LlamaForSequenceClassification`
    with its `score` head and a `pad_token_id` that is never an EOS, its tokenizer padding
    with that id: transformers' pooling then reads each row's closing EOS, where the
    learner trained it; see `common.score_head`)."""
    folders = []
    if adapter.enabled:
        _save_adapter(policy, rank, model_path, adapter, Path(path), head)
        folders.append(Path(path))
    if not adapter.enabled or adapter.save_merged:
        full = Path(path) / "merged" if adapter.enabled else Path(path)
        _save_full(policy, rank, model_path, adapter, full, head)
        folders.append(full)
    if rank != 0:
        return None
    for folder in folders:
        carry_model_files(model_path, folder)
        if head == "score":
            _pad_as_pooled(model_path, folder)
    return path


def _pad_as_pooled(model_path: str, folder: Path) -> None:
    """A reward model's tokenizer pads with the id its config pools around
    (`common.score_head.pooling_pad_id`), when that is not the source tokenizer's pad
    (pad = eos), so a batch right-padded by that tokenizer is pooled at each row's
    closing EOS by plain transformers too."""
    from transformers import AutoConfig, AutoTokenizer

    tok, config = AutoTokenizer.from_pretrained(model_path), AutoConfig.from_pretrained(model_path)
    pad = pooling_pad_id(tok, config.pad_token_id, config.eos_token_id)
    if pad is not None and pad != tok.pad_token_id:
        set_pad_token(folder, tok.convert_ids_to_tokens(pad))


def _save_full(
    policy: torch.nn.Module,
    rank: int,
    model_path: str,
    adapter: AdapterSettings,
    path: Path,
    head: str = "lm",
) -> None:
    full = full_state_dict(policy, rank, model_path, adapter, head)
    if rank != 0:
        return
    plain = adapters.meta_model(model_path, head)
    plain.load_state_dict(full, assign=True, strict=False)
    plain.tie_weights()
    path.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(path)


def _save_adapter(
    policy: torch.nn.Module,
    rank: int,
    model_path: str,
    adapter: AdapterSettings,
    path: Path,
    head: str = "lm",
) -> None:
    from safetensors.torch import save_file

    full = adapters.gather_params(policy, adapter_only=True, keep=rank == 0)
    if rank != 0:
        return
    state = adapters.peft_adapter_state(policy, full)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(path / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    adapters.lora_config(adapter, model_path, head).save_pretrained(str(path))


def _pairs(models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    for name, (model, opt) in models.items():
        m, o = get_state_dict(model, opt)
        out[name] = {"model": m, "optim": o}
    return out


def save_state(
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
    scheduler: Any,
    optimizer_steps: int,
    rank: int,
    path: str,
) -> None:
    """Write every (model, optimizer) pair of `models` (sharded, DCP) and this rank's
    scheduler, step count and RNGs into `path` (see the module docstring)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(_pairs(models), checkpoint_id=str(folder / "sharded"))
    torch.save(
        {
            "scheduler": scheduler.state_dict(),
            "optimizer_steps": optimizer_steps,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
        },
        folder / f"rank_{rank}.pt",
    )


def load_state(
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
    scheduler: Any,
    rank: int,
    path: str,
) -> int:
    """Load what `save_state` wrote into the live models, optimizers, scheduler and RNGs;
    returns the optimizer-step count.

    Raises:
        FileNotFoundError: `path` holds no training state.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    folder = Path(path)
    if not (folder / "rank_0.pt").is_file():
        raise FileNotFoundError(f"{folder}: no learner training state (rank_0.pt)")
    state = _pairs(models)
    dcp.load(state, checkpoint_id=str(folder / "sharded"))
    for name, (model, opt) in models.items():
        set_state_dict(
            model, opt, model_state_dict=state[name]["model"], optim_state_dict=state[name]["optim"]
        )
    own = folder / f"rank_{rank}.pt"
    extra = torch.load(own if own.is_file() else folder / "rank_0.pt", weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    if own.is_file():
        torch.set_rng_state(extra["torch_rng"])
        random.setstate(extra["python_rng"])
        np.random.set_state(extra["numpy_rng"])
    return extra["optimizer_steps"]
