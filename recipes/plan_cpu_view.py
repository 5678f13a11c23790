"""`posttrain plan --gpu cpu`: calibrate this machine (recipes/calibrate.py), predict one
step (recipes/plan_cpu.py) and print it with the measurements it came from."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from posttrain.config import Recipe
from posttrain.recipes.plan import GB, Hardware
from posttrain.recipes.plan_cpu import CpuCalibration, CpuStep, predict, worker_threads
from posttrain.recipes.planner import ModelShape, plan_recipe


def cpu_prediction(
    r: Recipe, folder: Path, shape: ModelShape, prompt_tokens: int
) -> tuple[CpuCalibration, CpuStep]:
    """Calibrate at the recipe's thread counts, then predict its step."""
    import os

    from posttrain.recipes.calibrate import calibrate

    cores = os.cpu_count() or 1
    t_r, t_l = worker_threads(r, cores)
    engines = r.resources.rollout.gpus // r.resources.rollout.gpus_per_engine
    batch = -(-r.train.prompts_per_step * r.rollout.samples_per_prompt // engines)
    cal = calibrate(
        folder,
        shape.hidden,
        shape.intermediate,
        {t_r, t_l},
        batch,
        prompt_tokens,
        t_r,
        t_l,
        prompt_tokens + r.rollout.max_new_tokens,
    )
    a = r.model.adapter
    trainable = shape.lora_params(a.r, a.target_modules) if a.type != "none" else shape.params
    return cal, predict(r, shape.params, trainable, prompt_tokens, cal)


def plan_cpu_or_exit(r: Recipe, folder: Path, shape: ModelShape, prompt_tokens: int) -> None:
    """Print the CPU plan of a GRPO/PPO recipe; exits 2 for DPO."""
    if r.algorithm == "dpo":
        typer.echo(
            "error: plan --gpu cpu predicts GRPO/PPO steps (generate, train, push); "
            "DPO has no rollout: use --gpu h100|h200|a100",
            err=True,
        )
        raise typer.Exit(code=2)
    cal, step = cpu_prediction(r, folder, shape, prompt_tokens)
    print_cpu_plan(r, shape, prompt_tokens, cal, step)


def print_cpu_plan(
    r: Recipe, shape: ModelShape, prompt_tokens: int, cal: CpuCalibration, s: CpuStep
) -> None:
    """The measurements, the step table, and the memory of all workers against RAM."""
    console = Console(width=120)
    rates = ", ".join(
        f"{t} thread{'s' if t > 1 else ''} {f / 1e9:.0f}"
        for t, f in sorted(cal.matmul_flops.items())
    )
    d, tp = cal.decode, cal.train
    console.print(
        f"measured in {cal.seconds:.1f} s on {cal.cores} cores: bf16 matmul GFLOP/s "
        f"({rates}); copy {cal.copy_bytes_per_s / GB:.1f} GB/s; loopback TCP "
        f"{cal.loopback_bytes_per_s / GB:.2f} GB/s; decode probe ({d.batch} seqs, "
        f"{d.threads} threads): prefill {d.prefill_s:.3f} s, {d.step_s * 1e3:.0f} ms/token; "
        f"forward+backward of {tp.tokens} tokens ({tp.threads} threads): {tp.seconds:.2f} s "
        f"= MFU {s.mfu:.0%} of the matmul rate",
        markup=False,
    )
    seqs = r.train.prompts_per_step * r.rollout.samples_per_prompt
    t = Table(
        title=f"step time on this CPU (s): {seqs} sequences x ({prompt_tokens} + "
        f"{r.rollout.max_new_tokens}) tokens; rollout {s.rollout_threads} threads, "
        f"{r.resources.learner.gpus} learner ranks x {s.learner_threads}"
    )
    for col in (
        "generate",
        "(decode roofline)",
        "train",
        "(compute",
        "AdamW",
        "FSDP comm)",
        "weight push",
        "step",
        "rollout idle",
        "learner idle",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        *(
            f"{x:.2f}"
            for x in (
                s.generate,
                s.decode_roofline,
                s.train,
                s.train_compute,
                s.optimizer,
                s.fsdp_comm,
                s.push,
                s.step,
                s.rollout_idle,
                s.learner_idle,
            )
        )
    )
    console.print(t)
    hw = Hardware(
        cal.ram_bytes,
        cal.copy_bytes_per_s,
        max(cal.matmul_flops.values()),
        cal.loopback_bytes_per_s,
        cal.loopback_bytes_per_s,
        "measured",
    )
    p = plan_recipe(r, shape, "cpu", prompt_tokens, s.mfu, hw=hw)
    engines = r.resources.rollout.gpus // r.resources.rollout.gpus_per_engine
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
    console.print(
        "not modelled: scoring, the controller, Ray calls, samples that stop "
        "early, other jobs on the machine (recipes/plan_cpu.py)",
        style="dim",
    )
