"""The cache of `posttrain plan --gpu cpu`'s calibrations: one JSON file per machine,
model folder and step shape under `~/.cache/posttrain/calibration/` (`plan
--recalibrate` measures again); what is measured is recipes/planning/calibrate.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from ...common.model_registry import cache_dir
from ...config import Recipe
from .calibrate import calibrate, ram_bytes
from .cpu import CpuCalibration, DecodeProbe, PushProbe, TrainProbe, worker_threads
from .shape import ModelShape


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else `platform.processor()`)."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def cache_key(r: Recipe, folder: Path, prompt_tokens: int) -> str:
    """What a calibration depends on: this machine (CPU model, cores, RAM, torch), the
    model folder (path and config time), the engine and the step's shape."""
    parts = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "ram": ram_bytes(),
        "torch": torch.__version__,
        "folder": str(folder.resolve()),
        "config_mtime": (folder / "config.json").stat().st_mtime,
        "engine": r.rollout.engine,
        "dtype": r.model.dtype,
        "vllm": r.rollout.vllm.model_dump(),
        "threads": worker_threads(r, os.cpu_count() or 1),
        "rollout": r.resources.rollout.gpus,
        "per_engine": r.resources.rollout.gpus_per_engine,
        "ranks": r.resources.learner.gpus,
        "prompts": r.train.prompts_per_step,
        "n": r.rollout.samples_per_prompt,
        "prompt_tokens": prompt_tokens,
        "new": r.rollout.max_new_tokens,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def from_json(d: dict) -> CpuCalibration:
    """A `CpuCalibration` from its `dataclasses.asdict` JSON (thread counts back to int).

    Raises:
        KeyError, TypeError: the file is not a calibration of this version.
    """
    return CpuCalibration(
        **{
            **d,
            "matmul_flops": {int(k): v for k, v in d["matmul_flops"].items()},
            "decode": DecodeProbe(**d["decode"]),
            "train": TrainProbe(**d["train"]),
            "push": PushProbe(**d["push"]),
        }
    )


def cached_calibration(
    r: Recipe, folder: Path, prompt_tokens: int, shape: ModelShape, recalibrate: bool = False
) -> tuple[CpuCalibration, Path | None]:
    """The calibration of `r` on this machine: read from the cache when one was measured
    for the same machine, model and step shape (and `recalibrate` is off), else measured
    now and saved. Returns it and the cache file it came from (None: measured now)."""
    path = cache_dir() / "calibration" / f"{cache_key(r, folder, prompt_tokens)}.json"
    if not recalibrate and path.exists():
        try:
            return from_json(json.loads(path.read_text())), path
        except (ValueError, KeyError, TypeError):
            pass  # an older or broken file: measure again and overwrite it
    cal = calibrate(r, folder, prompt_tokens, shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(cal), indent=1))
    tmp.replace(path)
    return cal, None
