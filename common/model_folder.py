"""Is a local transformers folder complete and readable? Checked before anything loads
it (no torch, no transformers): what `serve-rewards`, the reward-model component and
the recipe preflight ask, so a missing, truncated or broken folder is one line naming
the folder, the file and what is wrong with it, never a loader's traceback.

Checked: the folder exists; `config.json` is a JSON object; the weights exist and are
whole: `model.safetensors` (or every shard named by `model.safetensors.index.json`)
has a JSON header and as many bytes as that header describes, `pytorch_model.bin` (or
its shards) opens as a zip archive; a tokenizer file exists and `tokenizer.json` /
`tokenizer_config.json`, when present, are JSON.

`model_context` reads the context length a folder's config.json gives (as vLLM reads it).

Limits: this reads each safetensors header and each `.bin`'s zip directory, not the
tensors; weights whose bytes are all there but wrong (NaN, a different architecture)
pass here and fail (or score NaN) later. Legacy `.bin` pickles (not zip) are not
checked.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

SAFETENSORS = "model.safetensors"
TORCH_BIN = "pytorch_model.bin"
#: Files of which a transformers tokenizer needs at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_MAX_HEADER = 100 * 2**20  # safetensors caps its JSON header at 100 MB


def model_folder_problem(path: str | Path, tokenizer: bool = True) -> str | None:
    """What is wrong with the model folder at `path` (see the module docstring), as one
    sentence naming the folder or file; None when nothing is.

    Args:
        tokenizer: also require a tokenizer in the folder.
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        return f"{folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    config = folder / "config.json"
    if not config.is_file():
        return f"{folder} has no config.json (is it a transformers model folder?)"
    problem = _json_problem(config, want_object=True) or _weights_problem(folder)
    if problem is None and tokenizer:
        problem = _tokenizer_problem(folder)
    return problem


def _json_problem(f: Path, want_object: bool = False) -> str | None:
    try:
        data = json.loads(f.read_text())
    except OSError as e:
        return f"{f} cannot be read ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError) as e:
        return f"{f} is not valid JSON ({e}); is it truncated?"
    if want_object and not isinstance(data, dict):
        return f"{f} holds a JSON {type(data).__name__}, not an object"
    return None


def _weights_problem(folder: Path) -> str | None:
    for index, check in (
        (f"{SAFETENSORS}.index.json", _safetensors_problem),
        (f"{TORCH_BIN}.index.json", _torch_bin_problem),
    ):
        if (folder / index).is_file():
            return _sharded_problem(folder / index, check)
    if (folder / SAFETENSORS).is_file():
        return _safetensors_problem(folder / SAFETENSORS)
    if (folder / TORCH_BIN).is_file():
        return _torch_bin_problem(folder / TORCH_BIN)
    return (
        f"{folder} has no weights ({SAFETENSORS}, {TORCH_BIN} or a sharded "
        "index of them); was the model saved completely?"
    )


def _sharded_problem(index: Path, check) -> str | None:
    problem = _json_problem(index, want_object=True)
    if problem is not None:
        return problem
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        return f"{index} has no weight_map"
    for shard in sorted(set(map(str, weight_map.values()))):
        f = index.parent / shard
        if not f.is_file():
            return f"{f} is missing ({index.name} names it)"
        problem = check(f)
        if problem is not None:
            return problem
    return None


def _safetensors_problem(f: Path) -> str | None:
    """A safetensors file is 8 bytes of header length (little-endian), a JSON header
    giving each tensor's `data_offsets`, then the data."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > min(size - 8, _MAX_HEADER):
                return f"{f} is truncated or not a safetensors file ({size} bytes)"
            header = json.loads(fh.read(n))
    except OSError as e:
        return f"{f} cannot be read ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return f"{f} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{f} is not a safetensors file (its header is not a JSON object)"
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2
    ]
    if len(ends) != len([k for k in header if k != "__metadata__"]):
        return f"{f} is not a safetensors file (a tensor without data_offsets)"
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{f} is truncated: {size} bytes, its header describes {need}"
    return None


def _torch_bin_problem(f: Path) -> str | None:
    try:
        with open(f, "rb") as fh:
            if fh.read(2) != b"PK":
                return None  # a legacy pickle: not checked (module docstring)
        with zipfile.ZipFile(f) as z:
            z.namelist()
    except OSError as e:
        return f"{f} cannot be read ({e.strerror or e})"
    except zipfile.BadZipFile as e:
        return f"{f} is truncated or damaged ({e})"
    return None


def _tokenizer_problem(folder: Path) -> str | None:
    if not any((folder / n).is_file() for n in TOKENIZER_FILES):
        return f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / name).is_file() and (problem := _json_problem(folder / name)):
            return problem
    return None


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer: from tokenizer.json through `PreTrainedTokenizerFast`,
    which imports no torch (AutoTokenizer imports it: about 4 s of CPU here), else
    AutoTokenizer.

    Raises:
        OSError, ValueError: as transformers' `from_pretrained`.
    """
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# RoPE types whose `factor` vLLM 0.32 does not apply again to max_position_embeddings
# (config/model.py `_get_and_verify_max_len`); other types' factor scales the context.
_ROPE_ALREADY_SCALED = {
    "default",
    "su",
    "longrope",
    "llama3",
    "yarn",
    "deepseek_yarn",
    "deepseek_llama_scaling",
}


def model_context(config_file: Path) -> int | None:
    """The model's context in tokens: `max_position_embeddings` of config.json (or of
    its `text_config`), times a RoPE scaling factor where vLLM applies one; None when
    the file names no length."""
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # transformers will name the problem when it loads the config
    if "max_position_embeddings" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    n = cfg.get("max_position_embeddings")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return None
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if isinstance(factor, int | float) and kind not in _ROPE_ALREADY_SCALED:
        n = int(n * factor)
    return n
