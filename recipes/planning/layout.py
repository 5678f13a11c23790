"""The CPU learner's layout at the start of `posttrain run`: one process with every
learner core, or one FSDP2 rank per core, whichever `cpu.learner_layouts` predicts
faster, unless the recipe pins `resources.learner.gpus` (the shipped quickstart does not).

The prediction reads `posttrain plan --gpu cpu`'s cached calibration of this recipe on
this machine when there is one; otherwise a short probe measures what the two layouts'
difference depends on (about 1 s): the matmul rate of the model's MLP shape at 1 and at
all cores (the best of `PROBE_ROUNDS` interleaved rounds), the loopback rate (FSDP2's
traffic) and an AdamW step. The learner's MFU, which the full calibration measures with a
train step of the real model, is then taken as `PROBE_MFU` for both layouts (it only
weighs compute against traffic).

Kept only when the model, its fp32 gradients and AdamW state fit one process
(`fits_one_process`); otherwise the recipe's layout stays. Rollout algorithms only
(the planner's step model); SFT, DPO and reward models keep the recipe's layout.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ...config import Recipe
from .cpu import (
    CpuCalibration,
    DecodeProbe,
    LayoutChoice,
    PushProbe,
    TrainProbe,
    learner_layouts,
)
from .shape import ModelShape

#: Learner FLOP/s over the matmul rate assumed by the short probe: bench/learner.py's
#: GRPO train step reached 58% and its DPO step 47% of the bf16 matmul peak (H).
PROBE_MFU = 0.5

#: Rounds of the short probe's matmuls, the thread counts alternating, each rate the best
#: of its rounds (0.1 s each). With one 0.2 s measurement a thread count, a fresh clone's
#: asynchronous quickstart once predicted 8.62 s for 1 rank x 2 threads, against 4.41-4.46 s
#: in the runs around it on the same machine, and took 2 ranks.
PROBE_ROUNDS = 3

#: Bytes per parameter one learner process holds: fp32 master weights (4), their
#: compute-dtype copy (2), fp32 gradients (4) and AdamW's two fp32 moments (8).
BYTES_PER_PARAM = 18


def fits_one_process(params: float, ram_bytes: float, share: float = 0.5) -> bool:
    """Whether `BYTES_PER_PARAM`·params fit in `share` of the machine's RAM (the rest
    for activations, the rollout engine and the OS)."""
    return BYTES_PER_PARAM * params <= share * ram_bytes


def probe_calibration(r: Recipe, shape: ModelShape, cores: int) -> CpuCalibration:
    """The short probe (module docstring): a `CpuCalibration` whose decode and push
    probes are zeros (not measured; `learner_seconds` reads neither).

    Raises:
        AttributeError: `model.dtype` is not a torch dtype name (the schema allows
            only those).
    """
    import torch

    from .calibrate import measure_loopback, measure_matmul, ram_bytes

    t0 = time.perf_counter()
    dtype = getattr(torch, r.model.dtype)
    before = torch.get_num_threads()
    try:
        flops: dict[int, float] = {}
        for _ in range(PROBE_ROUNDS):  # interleaved: other work must cover every round
            for t in sorted({1, cores}):
                rate = measure_matmul(t, 256, shape.hidden, shape.intermediate, 0.1, dtype=dtype)
                flops[t] = max(flops.get(t, 0.0), rate)
        torch.set_num_threads(cores)
        loop = measure_loopback(16 * 2**20)
        adamw = _adamw_seconds_per_param()
    finally:
        torch.set_num_threads(before)
    tokens = 256
    train = TrainProbe(cores, 1, tokens, 6 * shape.params * tokens / (PROBE_MFU * flops[cores]))
    return CpuCalibration(
        cores,
        ram_bytes(),
        flops,
        0.0,
        loop,
        DecodeProbe("none", cores, 1, 1, 1, 0.0, 0.0),
        train,
        PushProbe(0.0, 1.0, 0.0, 0),
        adamw,
        time.perf_counter() - t0,
    )


def _adamw_seconds_per_param(numel: int = 2**21) -> float:
    """Seconds per parameter of one fused AdamW step (the learner's) on one fp32
    tensor; the first step (state allocation) untimed."""
    import torch

    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-6, fused=True)
    opt.step()
    t0 = time.perf_counter()
    opt.step()
    return (time.perf_counter() - t0) / numel


def run_layout(r: Recipe, prompts: list) -> Recipe:
    """`start_layout` for `posttrain run`'s recipe and training prompts, its line
    printed: the model folder and the longest prompt are looked up only when a
    prediction needs them (a bad prompt is left to the run's own check, which names
    it)."""
    from ...common.model_registry import resolve_model_path
    from ...config import RecipeError
    from ..preflight import checked_prompt_tokens

    res = r.resources
    tokens, folder = None, None
    if res.device == "cpu" and "gpus" not in res.learner.model_fields_set and prompts:
        try:
            tokens = checked_prompt_tokens(r, prompts, convert=True)
        except RecipeError:
            tokens = None
        folder = resolve_model_path(r.model.path) if tokens else None
    r, line = start_layout(r, folder, tokens)
    print(line, flush=True)
    return r


def start_layout(
    r: Recipe,
    folder: Path | None,
    prompt_tokens: int | None,
    cores: int | None = None,
    calibration: CpuCalibration | None = None,
) -> tuple[Recipe, str]:
    """The recipe with the learner layout this run takes, and the console line saying
    which and why (module docstring).

    Args:
        folder: the model's folder (its config.json gives the shape).
        prompt_tokens: the longest prompt after the chat template. Either None: not
            predicted, the recipe's layout stays.
        cores: the machine's (default `os.cpu_count()`).
        calibration: measurements to predict from (default: the plan's cached one,
            else `probe_calibration`).

    Returns:
        `(recipe, line)`; the recipe is `r` itself unless the layout changed.
    """
    res = r.resources
    mine = f"{res.learner.gpus} rank(s)"
    if res.device != "cpu":
        return r, f"learner layout: {mine} on {res.device} (the recipe's)"
    if "gpus" in res.learner.model_fields_set:
        return r, f"learner layout: {mine}, pinned by resources.learner.gpus"
    if not r.facts.uses_rollouts:
        why = f"the planner predicts rollout steps, not {r.algorithm}'s"
        return r, f"learner layout: {mine}, the recipe's ({why})"
    if not prompt_tokens or folder is None:
        return r, f"learner layout: {mine}, the recipe's (the prompts' length is not known)"
    shape = ModelShape.from_config(Path(folder) / "config.json")
    cores = cores or os.cpu_count() or 1
    cal = calibration or _cached(r, folder, prompt_tokens) or probe_calibration(r, shape, cores)
    if not fits_one_process(shape.params, cal.ram_bytes):
        need = BYTES_PER_PARAM * shape.params / 2**30
        return r, f"learner layout: {mine} (one process would hold {need:.1f} GiB: the recipe's)"
    a = r.model.adapter
    trainable = shape.lora_params(a.r, a.target_modules) if a.type != "none" else shape.params
    choice: LayoutChoice = learner_layouts(
        r, shape.params, trainable, prompt_tokens, cal, shape.hidden, shape.intermediate
    )
    line = f"{choice.reason} -> {choice.ranks} rank(s) x {choice.threads} thread(s)"
    if choice.ranks == res.learner.gpus:
        return r, line
    learner = res.learner.model_copy(update={"gpus": choice.ranks})
    return r.model_copy(update={"resources": res.model_copy(update={"learner": learner})}), line


def _cached(r: Recipe, folder: Path, prompt_tokens: int) -> CpuCalibration | None:
    """`posttrain plan --gpu cpu`'s calibration of `r` on this machine, if cached."""
    import json

    from ...common.model_registry import cache_dir
    from .calibration_cache import cache_key, from_json

    path = cache_dir() / "calibration" / f"{cache_key(r, folder, prompt_tokens)}.json"
    try:
        return from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
