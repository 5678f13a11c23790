"""`posttrain plan --gpu cpu`: calibrate this machine (recipes/planning/calibrate.py), predict one
step (recipes/planning/cpu.py) and print it with the measurements it came from."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ...config import Recipe
from .cpu import CpuCalibration, CpuStep, learner_layouts, predict
from .formulas import GB, Hardware
from .planner import ModelShape, plan_recipe


def cpu_prediction(
    r: Recipe, folder: Path, shape: ModelShape, prompt_tokens: int, recalibrate: bool = False
) -> tuple[CpuCalibration, CpuStep, Path | None]:
    """Calibrate at the recipe's engine, thread counts and batch (or read the cached
    calibration of the same machine and shape), then predict its step. The third value
    is the cache file the calibration came from (None: measured now)."""
    from .calibration_cache import cached_calibration

    cal, cached = cached_calibration(r, folder, prompt_tokens, shape, recalibrate)
    a = r.model.adapter
    trainable = shape.lora_params(a.r, a.target_modules) if a.type != "none" else shape.params
    step = predict(r, shape.params, trainable, prompt_tokens, cal, shape.hidden, shape.intermediate)
    return cal, step, cached


def plan_cpu_or_exit(
    r: Recipe, folder: Path, shape: ModelShape, prompt_tokens: int, recalibrate: bool = False
) -> None:
    """Print the CPU plan of a rollout recipe (GRPO, PPO); exits 2 for one that trains on
    preference pairs (DPO, a reward model)."""
    if not r.facts.uses_rollouts:
        typer.echo(
            "error: plan --gpu cpu predicts rollout steps (generate, train, push); "
            f"{r.algorithm} trains on preference pairs, with no rollout: use "
            "--gpu h100|h200|a100",
            err=True,
        )
        raise typer.Exit(code=2)
    cal, step, cached = cpu_prediction(r, folder, shape, prompt_tokens, recalibrate)
    print_cpu_plan(r, shape, prompt_tokens, cal, step, cached)
    a = r.model.adapter
    trainable = shape.lora_params(a.r, a.target_modules) if a.type != "none" else shape.params
    layout = learner_layouts(
        r, shape.params, trainable, prompt_tokens, cal, shape.hidden, shape.intermediate
    )
    print(layout.reason)


def print_cpu_plan(
    r: Recipe,
    shape: ModelShape,
    prompt_tokens: int,
    cal: CpuCalibration,
    s: CpuStep,
    cached: Path | None = None,
) -> None:
    """The measurements, the step table, and the memory of all workers against RAM."""
    console = Console(width=120)
    _print_calibration(console, r, cal, s, cached)
    console.print(_step_table(r, prompt_tokens, s))
    _print_memory(console, r, shape, prompt_tokens, cal, s)
    console.print(
        "not modelled: scoring, the controller, Ray calls, samples that stop "
        "early, other jobs on the machine (recipes/planning/cpu.py)",
        style="dim",
    )


def _print_calibration(
    console: Console, r: Recipe, cal: CpuCalibration, s: CpuStep, cached: Path | None
) -> None:
    """What was measured, and a warning when more threads measured slower (a loaded
    machine)."""
    rates = ", ".join(
        f"{t} thread{'s' if t > 1 else ''} {f / 1e9:.0f}"
        for t, f in sorted(cal.matmul_flops.items())
    )
    d, tp, pp = cal.decode, cal.train, cal.push
    when = (
        f"cached, measured {cal.measured_at} in {cal.seconds:.1f} s ({cached}; --recalibrate "
        "measures again)"
        if cached
        else f"measured in {cal.seconds:.1f} s"
    )
    console.print(
        f"{when} on {cal.cores} cores: {r.model.dtype} matmul GFLOP/s "
        f"({rates}); copy {cal.copy_bytes_per_s / GB:.1f} GB/s; loopback TCP "
        f"{cal.loopback_bytes_per_s / GB:.2f} GB/s; decode probe ({d.engine} engine, {d.batch} "
        f"seqs, {d.threads} threads): prefill {d.prefill_s:.3f} s, {d.step_s * 1e3:.0f} "
        f"ms/token; engine load of {pp.load_bytes / 1e6:.0f} MB: {pp.load_s:.2f} s; gloo "
        f"all-gather latency {pp.collective_s * 1e3:.2f} ms x {pp.tensors} tensors; "
        f"forward+backward of {tp.tokens} tokens ({tp.threads} threads): {tp.seconds:.2f} s "
        f"= MFU {s.mfu:.0%} of the matmul rate; AdamW {cal.adamw_s_per_param * 1e9:.1f} "
        "ns/param",
        markup=False,
    )
    rates_by_threads = [f for _, f in sorted(cal.matmul_flops.items())]
    if any(b < a for a, b in zip(rates_by_threads, rates_by_threads[1:], strict=False)):
        console.print(
            "[yellow]warning[/yellow]: more threads measured a lower matmul rate than fewer "
            "(other jobs are using the cores): every figure below carries that load, the "
            "decode roofline most; measure again on a quiet machine with --recalibrate"
        )


#: The step table's columns and the `CpuStep` field each shows.
STEP_COLUMNS = {
    "generate": "generate",
    "(decode roofline)": "decode_roofline",
    "train": "train",
    "(compute": "train_compute",
    "AdamW": "optimizer",
    "FSDP comm)": "fsdp_comm",
    "weight push": "push",
    "step": "step",
    "rollout idle": "rollout_idle",
    "learner idle": "learner_idle",
}


def _step_table(r: Recipe, prompt_tokens: int, s: CpuStep) -> Table:
    """One row: the predicted step and its parts, seconds."""
    seqs = r.train.prompts_per_step * r.rollout.samples_per_prompt
    t = Table(
        title=f"step time on this CPU (s): {seqs} sequences x ({prompt_tokens} + "
        f"{r.rollout.max_new_tokens}) tokens; rollout {s.rollout_threads} threads, "
        f"{r.resources.learner.gpus} learner ranks x {s.learner_threads}"
    )
    for col in STEP_COLUMNS:
        t.add_column(col, justify="right")
    t.add_row(*(f"{getattr(s, field):.2f}" for field in STEP_COLUMNS.values()))
    return t


def _print_memory(
    console: Console,
    r: Recipe,
    shape: ModelShape,
    prompt_tokens: int,
    cal: CpuCalibration,
    s: CpuStep,
) -> None:
    """Every worker's model state and activations against this machine's RAM."""
    hw = Hardware(
        cal.ram_bytes,
        cal.copy_bytes_per_s,
        max(cal.matmul_flops.values()),
        cal.loopback_bytes_per_s,
        cal.loopback_bytes_per_s,
        "measured",
    )
    p = plan_recipe(r, shape, "cpu", prompt_tokens, s.mfu, hw=hw)
    engines = r.resources.rollout.engines
    total = r.resources.learner.gpus * p.learner_total + engines * p.engine_total
    console.print(
        f"memory: {r.resources.learner.gpus} learner ranks x "
        f"{p.learner_total / GB:.2f} GB + {engines} engine(s) x "
        f"{p.engine_total / GB:.2f} GB = {total / GB:.2f} GB of "
        f"{cal.ram_bytes / GB:.1f} GB RAM (model state and activations only; "
        "each process also holds its libraries)"
    )
    if total > cal.ram_bytes:
        console.print(
            "[red]does not fit[/red]: lower train.micro_batch_size or "
            "resources.learner.gpus, or set model.adapter.type: lora"
        )
