"""`posttrain plan`'s inputs and its console tables: finds the model's config.json and the
longest prompt (tokenizing the prompts once, with the length check), runs
`planner.plan_recipe` (GPUs) or calibrates this machine and runs `plan_cpu.predict`
(`--gpu cpu`), prints the result with rich."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ...config import Recipe, RecipeError
from .formulas import GB
from .planner import Cluster, ModelShape, RecipePlan, Times, plan_recipe


def main(
    r: Recipe,
    prompts: list,
    gpu: str,
    mfu: float,
    nodes: int | None,
    gpus_per_node: int | None,
    recalibrate: bool = False,
) -> None:
    """`posttrain plan`: print the GPU plan, or calibrate and print the CPU one."""
    folder, shape, tokens = inputs_or_exit(r, prompts)
    if gpu != "cpu":
        cluster = Cluster(nodes, gpus_per_node) if nodes and gpus_per_node else None
        print_plan(plan_recipe(r, shape, gpu, tokens, mfu, cluster))
        return
    from .cpu_view import plan_cpu_or_exit

    plan_cpu_or_exit(r, folder, shape, tokens, recalibrate)


def inputs_or_exit(r: Recipe, prompts: list) -> tuple[Path, ModelShape, int]:
    """The model folder, its sizes and the longest prompt in tokens (checked against the
    context as `validate` does); exits 2 when the model's config.json is not here (a
    built-in alias not converted yet: nothing is downloaded or converted) or a prompt
    does not fit."""
    from ...common.model_registry import readable_model_folder
    from ..preflight import checked_prompt_tokens

    folder = readable_model_folder(r.model.path, convert=False)
    if folder is None:
        typer.echo(
            f"error: model.path {r.model.path!r} is a built-in alias not converted yet "
            "(plan never downloads or converts); `posttrain run` converts it once, or "
            "give a local transformers folder with --set model.path=FOLDER",
            err=True,
        )
        raise typer.Exit(code=2)
    try:
        shape = ModelShape.from_config(Path(folder) / "config.json")
    except (OSError, ValueError, KeyError) as e:
        typer.echo(
            f"error: model.path: cannot read the sizes in {folder}/config.json ({e}); "
            "plan reads Llama-style configs",
            err=True,
        )
        raise typer.Exit(code=2) from None
    try:
        tokens = checked_prompt_tokens(r, prompts)
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    return Path(folder), shape, tokens or 0


def _gb(x: float) -> str:
    return f"{x / GB:.3f}" if x < 10 * GB else f"{x / GB:.1f}"


def _s(x: float) -> str:
    return f"{x:.3g}"


def print_plan(p: RecipePlan) -> None:
    """One table of memory (GB = 1e9 bytes), one of time (seconds), then the flags."""
    console = Console(width=120)
    console.print(_memory_table(p))
    console.print(_time_table(p))
    for f in p.flags:
        console.print(f"[red]does not fit[/red]: {f}")
    if p.best and (p.best.rollout, p.best.learner) != (p.times.rollout, p.times.learner):
        console.print(
            f"suggest: resources.rollout.gpus: {p.best.rollout}, "
            f"resources.learner.gpus: {p.best.learner} (step "
            f"{_s(p.times.step)} s -> {_s(p.best.step)} s)"
        )
    if p.cluster:
        console.print(
            f"split searched over {p.cluster.devices} devices; weight push over "
            f"NVLink {p.hw.nvlink_one_way_bytes_per_s / GB:.0f} GB/s (one way) "
            f"within a node, the NIC {p.hw.network_bytes_per_s / GB:.0f} GB/s "
            "across nodes",
            style="dim",
        )
    console.print(f"hardware: {p.hw.source}", style="dim")


def _memory_table(p: RecipePlan) -> Table:
    """Bytes per device of each side by part, in GB, with each side's total (marked
    when it exceeds the device's memory)."""
    hbm = p.hw.hbm_bytes
    where = f" ({p.cluster.nodes} nodes x {p.cluster.gpus_per_node})" if p.cluster else ""
    mem = Table(title=f"memory per device on {p.gpu} ({hbm / GB:.0f} GB){where}")
    for col in ("side", "part", "GB"):
        mem.add_column(col, justify="right" if col == "GB" else "left")
    for side, parts, total in (
        ("learner", p.learner_memory, p.learner_total),
        ("rollout", p.engine_memory, p.engine_total),
    ):
        if not parts:
            continue
        for k, v in parts.items():
            mem.add_row(side, k, _gb(v))
        mem.add_row(
            side,
            "[bold]total[/bold]",
            f"[bold]{_gb(total)}[/bold]" + ("" if total <= hbm else " [red]does not fit[/red]"),
        )
    return mem


def _time_table(p: RecipePlan) -> Table:
    """Seconds of each phase of the step for the recipe's split and the best split."""
    t = Table(
        title=f"step time (s): {p.sequences} sequences x ({p.prompt_tokens} + "
        f"{p.response_tokens}) tokens; train at MFU {p.mfu:.0%} of "
        f"{p.hw.bf16_flops / 1e12:.0f} TFLOP/s"
    )
    for col in (
        "split rollout:learner",
        "decode",
        "train",
        "weight push",
        "step",
        "rollout idle",
        "learner idle",
    ):
        t.add_column(col, justify="right")
    rows = [("recipe", p.times)] + ([("best", p.best)] if p.best else [])
    for label, x in rows:
        t.add_row(f"{label} {x.rollout}:{x.learner}", *_times_cells(x))
    return t


def _times_cells(x: Times) -> list[str]:
    step = x.step or 1.0
    rollout_idle = f"{x.train / step:.2f}" if x.rollout else "–"  # DPO: no rollout side
    push = _s(x.push) + (" (NIC)" if x.cross_node else "")
    return [_s(x.decode), _s(x.train), push, _s(x.step), rollout_idle, f"{x.decode / step:.2f}"]
