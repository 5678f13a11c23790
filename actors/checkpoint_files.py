"""What a model folder's safetensors files hold, read from their headers only: the
tensor names an engine's pushes must cover and the parameter count that sizes its
threads."""

from __future__ import annotations

import json
import math
from pathlib import Path


def checkpoint_names(model_path: str) -> set[str]:
    """Tensor names in a transformers folder's safetensors files."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    return names


def checkpoint_params(model_path: str) -> int:
    """Elements of every tensor in a transformers folder's safetensors files (headers
    only; tied tensors stored once count once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                total += math.prod(st.get_slice(k).get_shape())
    return total
