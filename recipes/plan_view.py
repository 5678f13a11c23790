"""`posttrain plan`'s inputs and its console table: finds the model's config.json and the
longest prompt, runs `planner.plan_recipe`, prints the result with rich."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from posttrain.config import Recipe, RecipeError
from posttrain.recipes.plan import GB
from posttrain.recipes.planner import ModelShape, RecipePlan, Times, plan_recipe


def plan_or_exit(r: Recipe, prompts: list, gpu: str, mfu: float) -> RecipePlan:
    """The plan of a validated recipe; exits 2 when the model's config.json is not here
    (a built-in alias not converted yet: nothing is downloaded or converted)."""
    from posttrain.recipes.preflight import _longest_prompt, _readable_model_folder

    folder = _readable_model_folder(r.model.path, convert=False)
    if folder is None:
        typer.echo(f"error: model.path {r.model.path!r} is a built-in alias not converted yet "
                   "(plan never downloads or converts); `posttrain run` converts it once, or "
                   "give a local transformers folder with --set model.path=FOLDER", err=True)
        raise typer.Exit(code=2)
    try:
        shape = ModelShape.from_config(Path(folder) / "config.json")
    except (OSError, ValueError, KeyError) as e:
        typer.echo(f"error: model.path: cannot read the sizes in {folder}/config.json ({e}); "
                   "plan reads Llama-style configs", err=True)
        raise typer.Exit(code=2) from None
    try:
        pairs = r.algorithm in ("dpo", "reward_model")
        tokens = 0 if pairs else _longest_prompt(Path(folder), r, prompts)[0]
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    return plan_recipe(r, shape, gpu, tokens, mfu)


def _gb(x: float) -> str:
    return f"{x / GB:.3f}" if x < 10 * GB else f"{x / GB:.1f}"


def _s(x: float) -> str:
    return f"{x:.3g}"


def print_plan(p: RecipePlan) -> None:
    """One table of memory (GB = 1e9 bytes), one of time (seconds), then the flags."""
    console = Console(width=120)
    hbm = p.hw.hbm_bytes
    mem = Table(title=f"memory per device on {p.gpu} ({hbm / GB:.0f} GB)")
    for col in ("side", "part", "GB"):
        mem.add_column(col, justify="right" if col == "GB" else "left")
    for side, parts, total in (("learner", p.learner_memory, p.learner_total),
                               ("rollout", p.engine_memory, p.engine_total)):
        if not parts:
            continue
        for k, v in parts.items():
            mem.add_row(side, k, _gb(v))
        mem.add_row(side, "[bold]total[/bold]", f"[bold]{_gb(total)}[/bold]"
                    + ("" if total <= hbm else " [red]does not fit[/red]"))
    console.print(mem)
    t = Table(title=f"step time (s): {p.sequences} sequences x ({p.prompt_tokens} + "
                    f"{p.response_tokens}) tokens; train at MFU {p.mfu:.0%} of "
                    f"{p.hw.bf16_flops / 1e12:.0f} TFLOP/s")
    for col in ("split rollout:learner", "decode", "train", "weight push", "step",
                "rollout idle", "learner idle"):
        t.add_column(col, justify="right")
    rows = [("recipe", p.times)] + ([("best", p.best)] if p.best else [])
    for label, x in rows:
        t.add_row(f"{label} {x.rollout}:{x.learner}", *_times_cells(x))
    console.print(t)
    for f in p.flags:
        console.print(f"[red]does not fit[/red]: {f}")
    if p.best and (p.best.rollout, p.best.learner) != (p.times.rollout, p.times.learner):
        console.print(f"suggest: resources.rollout.gpus: {p.best.rollout}, "
                      f"resources.learner.gpus: {p.best.learner} (step "
                      f"{_s(p.times.step)} s -> {_s(p.best.step)} s)")
    console.print(f"hardware: {p.hw.source}", style="dim")


def _times_cells(x: Times) -> list[str]:
    step = x.step or 1.0
    rollout_idle = f"{x.train / step:.2f}" if x.rollout else "–"  # DPO: no rollout side
    return [_s(x.decode), _s(x.train), _s(x.push), _s(x.step), rollout_idle,
            f"{x.decode / step:.2f}"]
