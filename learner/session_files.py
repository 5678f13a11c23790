"""A session's files: the adapter in PEFT format and its AdamW state, as whole tensors
(rank 0 writes, every rank reads), so a save reloads bit for bit on any number of
learner ranks.

Folder layout (`save` / `read`):
- `adapter_model.safetensors`, `adapter_config.json`: the adapter at its true rank r,
  PEFT names (`...q_proj.lora_A.weight` `[r, in]`), `LoraConfig(r, lora_alpha=r)`:
  `PeftModel.from_pretrained(base, folder)` loads it.
- `optimizer.safetensors` (only with the optimizer): per PEFT name `NAME.exp_avg`,
  `NAME.exp_avg_sq` (whole, float32) and `NAME.step` (AdamW's float32 step count).
- `session.json`: `rank`, `targets`, `step`, `optimizer` (whether the state is there).

The folder must be visible to every learner rank (one machine, or a shared filesystem).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .session_slot import SlotParam, local_part

OPT_KEYS = ("exp_avg", "exp_avg_sq")


def lora_config(rank: int, targets: tuple[str, ...], base: str):  # noqa: ANN201
    """Tinker's LoRA config of a rank-`rank` session: alpha = rank (scale 1)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=rank,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def config_dict(rank: int, targets: tuple[str, ...], base: str) -> dict:
    """`lora_config` as plain JSON-able values (sets as sorted lists, enums as values),
    as `meta["adapter_config"]` of a push carries it."""
    raw = lora_config(rank, targets, base).to_dict()
    return {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in raw.items()}


@dataclass
class Saved:
    """What `read` found: the adapter's whole tensors by PEFT name, the AdamW state by
    `NAME.key` (None: saved without it) and `session.json`'s values."""

    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None
    rank: int
    targets: tuple[str, ...]
    step: int


def save(
    folder: Path,
    adapter: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor] | None,
    rank: int,
    targets: tuple[str, ...],
    step: int,
    base: str,
) -> None:
    """Write a session (module docstring); rank 0 only."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in adapter.items()},
        str(folder / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    lora_config(rank, targets, base).save_pretrained(str(folder))
    if optimizer is not None:
        save_file(
            {k: v.contiguous() for k, v in optimizer.items()},
            str(folder / "optimizer.safetensors"),
        )
    info = {
        "rank": rank,
        "targets": list(targets),
        "step": step,
        "optimizer": optimizer is not None,
    }
    tmp = folder / "session.json.tmp"
    tmp.write_text(json.dumps(info))
    tmp.replace(folder / "session.json")  # written last: its presence means complete


def read(folder: Path, want_optimizer: bool) -> Saved:
    """Read what `save` wrote.

    Raises:
        FileNotFoundError: `folder` holds no saved session (no `session.json`).
        ValueError: `want_optimizer` and the session was saved without its optimizer
            (load with optimizer=False, or save with optimizer=True).
    """
    from safetensors.torch import load_file

    info_path = folder / "session.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"{folder}: no saved session (session.json missing)")
    info = json.loads(info_path.read_text())
    if want_optimizer and not info["optimizer"]:
        raise ValueError(
            f"{folder}: saved without its optimizer state; load it with optimizer=False "
            "(fresh AdamW moments), or save with optimizer=True"
        )
    adapter = load_file(str(folder / "adapter_model.safetensors"))
    opt = load_file(str(folder / "optimizer.safetensors")) if want_optimizer else None
    return Saved(adapter, opt, int(info["rank"]), tuple(info["targets"]), int(info["step"]))


def need(tensors: dict[str, torch.Tensor], name: str, folder: Path) -> torch.Tensor:
    """`tensors[name]`, or a ValueError naming the folder and the missing tensor."""
    if name not in tensors:
        raise ValueError(f"{folder}: no tensor {name} (saved by another model or targets?)")
    return tensors[name]


def parts(
    saved: Saved, slots: list[SlotParam], trained: list, r: int, folder: Path
) -> tuple[list[torch.Tensor | None], list[dict[str, torch.Tensor] | None]]:
    """This rank's parts of a saved session, per slot tensor (None where `trained[i]` is
    None): the adapter, and AdamW's state (`step`, `exp_avg`, `exp_avg_sq`) when saved
    with it (else an empty list).

    Raises:
        ValueError: a tensor is missing (names the folder) or has another shape.
    """
    params: list[torch.Tensor | None] = []
    state: list[dict[str, torch.Tensor] | None] = []
    for sl, mine in zip(slots, trained, strict=True):
        if mine is None:
            params.append(None)
            state.append(None)
            continue
        params.append(local_part(sl, need(saved.adapter, sl.peft_name, folder), r))
        if saved.optimizer is not None:
            got = {k: need(saved.optimizer, f"{sl.peft_name}.{k}", folder) for k in OPT_KEYS}
            step = need(saved.optimizer, f"{sl.peft_name}.step", folder).clone()
            state.append({"step": step, **{k: local_part(sl, v, r) for k, v in got.items()}})
    return params, state if saved.optimizer is not None else []
