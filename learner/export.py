"""Carry a source model folder's non-weight files into a saved checkpoint.

A checkpoint written by `save_pretrained` on a model rebuilt from its config keeps
only what the config knows: `generation_config.json` is regenerated from
`config.json` (a list `eos_token_id` such as `[3, 2]` collapses to `3`, sampling
defaults such as `temperature` and `top_p` are lost), and a tokenizer re-saved by
`AutoTokenizer.save_pretrained` may drop files the source shipped (a
`chat_template.jinja`, a `tokenizer.model`, custom tokenizer code). `carry_model_files`
copies those files verbatim from the source folder after each save (full policy,
adapter folder, merged folder), overwriting what `save_pretrained` wrote.

What is copied: `generation_config.json`, the tokenizer's files (`tokenizer*`,
`special_tokens_map.json`, `added_tokens.json`, `vocab.*`, `merges.txt`, `*.model`,
`*.tiktoken`, `chat_template.json`, `chat_template.jinja`, the
`additional_chat_templates/` folder, `tokenization_*.py`). Never copied: weights,
`config.json`, adapter files, or anything else in the folder.

Limits: the source must be a local folder (resolve hub ids and aliases first, e.g.
with `posttrain.common.model_registry.resolve_model_path`); nothing is downloaded.
Not atomic: a crash mid-copy leaves some files carried and some not.
"""

from __future__ import annotations

import filecmp
import fnmatch
import json
import shutil
from pathlib import Path

#: Top-level file names (glob patterns) of the source folder that a checkpoint carries.
CARRIED_PATTERNS: tuple[str, ...] = (
    "generation_config.json",
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",  # vocab.json, vocab.txt
    "merges.txt",
    "*.model",  # sentencepiece: spiece.model, sentencepiece.bpe.model
    "*.tiktoken",
    "chat_template.json",
    "chat_template.jinja",
    "tokenization_*.py",  # custom tokenizer code named in tokenizer_config's auto_map
)
#: Folders of the source carried whole.
CARRIED_FOLDERS: tuple[str, ...] = ("additional_chat_templates",)
#: Never carried, even when a pattern above matches (weights and model config).
NEVER_CARRIED: tuple[str, ...] = (
    "config.json",
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.index.json",
    "adapter_*",
)


def _carried(name: str) -> bool:
    if any(fnmatch.fnmatch(name, p) for p in NEVER_CARRIED):
        return False
    return any(fnmatch.fnmatch(name, p) for p in CARRIED_PATTERNS)


def model_file_names(source: str | Path) -> list[str]:
    """Sorted names (relative to `source`, `/`-separated) of the files a checkpoint
    carries from `source`: files of folders in `CARRIED_FOLDERS` appear as `folder/name`.

    Raises:
        FileNotFoundError: `source` is not a folder.
    """
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(
            f"model folder {source} does not exist or is not a folder; "
            "pass the local folder the policy was loaded from"
        )
    names = [p.name for p in source.iterdir() if p.is_file() and _carried(p.name)]
    for folder in CARRIED_FOLDERS:
        if (source / folder).is_dir():
            names += [
                p.relative_to(source).as_posix()
                for p in (source / folder).rglob("*")
                if p.is_file()
            ]
    return sorted(names)


def carry_model_files(source: str | Path, dest: str | Path) -> list[str]:
    """Copy `source`'s generation config and tokenizer files into `dest`, overwriting
    files of the same name there; call after every `save_pretrained` into `dest`.

    Args:
        source: the local model folder the policy was loaded from.
        dest: a checkpoint folder (created if missing).

    Returns:
        Sorted names copied, relative to `dest` (see `model_file_names`); empty when
        `source` and `dest` are the same folder.

    Raises:
        FileNotFoundError: `source` is not a folder.
        OSError: a file could not be copied (disk full, permissions).
    """
    source, dest = Path(source), Path(dest)
    names = model_file_names(source)
    if dest.exists() and dest.resolve() == source.resolve():
        return []
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, target)
    return names


def differing_model_files(source: str | Path, dest: str | Path) -> list[str]:
    """Names of the files `carry_model_files` would copy from `source` that are
    missing from `dest` or differ in content; empty when `dest` carries them all.
    For tests and checks of a saved run (e.g. `assert not differing_model_files(model,
    run_dir / "final")`).

    Raises:
        FileNotFoundError: `source` is not a folder.
    """
    source, dest = Path(source), Path(dest)
    return [
        n
        for n in model_file_names(source)
        if not (dest / n).is_file() or not filecmp.cmp(source / n, dest / n, shallow=False)
    ]


def set_pad_token(folder: str | Path, token: str) -> list[str]:
    """Make `token` the pad token of the tokenizer saved in `folder`: the `pad_token` of
    its `tokenizer_config.json` and, where it names one, `special_tokens_map.json`
    (a reward model's folder, whose config pads with an id that is never an EOS: see
    `common.score_head.pooling_pad_id`). Returns the names of the files changed.

    Raises:
        OSError: a file could not be read or written.
        json.JSONDecodeError: a file is not JSON.
    """
    changed = []
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = Path(folder) / name
        if not f.is_file():
            continue
        data = json.loads(f.read_text())
        if name == "special_tokens_map.json" and "pad_token" not in data:
            continue
        old = data.get("pad_token")
        data["pad_token"] = {**old, "content": token} if isinstance(old, dict) else token
        f.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        changed.append(name)
    return changed
