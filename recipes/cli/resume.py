"""The checks of `posttrain run --resume RUN_DIR` before anything starts: the folder is
a run folder, its newest checkpoint is complete and whole (its manifest), the recipe
changes nothing a resume cannot carry (`checkpoints.resume_changes`), `train.steps`
goes past the checkpoint, and the training data is the data the checkpoint was made
with (unless `--accept-data-change`).

Each check prints one line naming the folder or key and the fix, and exits 2
(`typer.Exit`); nothing here imports torch or Ray.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ...config import Recipe, RecipeError
from .. import checkpoints
from ..loading import load_recipe


def checkpoint_or_exit(run_dir: Path) -> Path:
    """The newest complete, whole checkpoint of `run_dir`; exit 2 when there is none."""
    if not run_dir.is_dir() or not (run_dir / "recipe.yaml").is_file():
        what = "is not a folder" if not run_dir.is_dir() else "has no recipe.yaml"
        typer.echo(
            f"error: --resume {run_dir}: {what}, so it is not a run folder; give the "
            "RUN_DIR a `posttrain run` made (it prints it; the default is "
            "runs/NAME-TIME)",
            err=True,
        )
        raise typer.Exit(code=2)
    last = checkpoints.latest(run_dir)
    if last is None:
        typer.echo(
            f"error: --resume {run_dir}: no complete checkpoint in "
            f"{run_dir / checkpoints.FOLDER} (train.checkpoint_every writes them); "
            f"start over with: posttrain run {run_dir / 'recipe.yaml'} --out NEW_DIR",
            err=True,
        )
        raise typer.Exit(code=2)
    _verify_or_exit(run_dir, last)
    return last


def _verify_or_exit(run_dir: Path, checkpoint: Path) -> None:
    """A checkpoint whose files differ from its manifest: exit 2 naming the file and
    offering the newest whole checkpoint before it (nothing has started yet)."""
    try:
        if not checkpoints.verify(checkpoint):
            typer.echo(f"note: {checkpoint.name} has no manifest (an older posttrain wrote it)")
        return
    except checkpoints.CheckpointDamaged as e:
        damaged = e
    aside = checkpoint.parent / f"damaged-{checkpoint.name}"
    previous = checkpoints.whole_before(checkpoint)
    offer = (
        f"The previous checkpoint {previous.name} is whole; to resume from it, move the "
        f"damaged one aside: mv {checkpoint} {aside} && posttrain run --resume {run_dir}"
        if previous is not None
        else "no earlier checkpoint is whole; start over with: posttrain run "
        f"{run_dir / 'recipe.yaml'} --out NEW_DIR"
    )
    typer.echo(
        f"error: --resume {run_dir}: checkpoint {checkpoint.name} is damaged: {damaged}. {offer}",
        err=True,
    )
    raise typer.Exit(code=2)


def check_data_or_exit(r: Recipe, checkpoint: Path, data: list, accept: bool) -> None:
    """Refuse (exit 2) training data that differs from the checkpoint's, unless
    `accept` (`--accept-data-change`): then say so and continue."""
    change = checkpoints.data_change(checkpoint, r, data)
    if change is None:
        return
    if accept:
        typer.echo(f"warning: --resume: {change}; continuing (--accept-data-change)", err=True)
        return
    typer.echo(
        f"error: --resume: {change}. Put the original data back, or continue on this "
        "data anyway with --accept-data-change",
        err=True,
    )
    raise typer.Exit(code=2)


def check_resume_or_exit(r: Recipe, checkpoint: Path) -> None:
    """Refuse (exit 2) a recipe that changes what a resume cannot, or whose
    `train.steps` does not go past the checkpoint; print what it changes."""
    try:
        changes = checkpoints.resume_changes(load_recipe(checkpoint / "recipe.yaml"), r)
    except RecipeError as e:
        typer.echo(f"error: --resume: {e}", err=True)
        raise typer.Exit(code=2) from None
    done = checkpoints.read_state(checkpoint)["step"]
    if r.train.steps <= done:
        typer.echo(
            f"error: --resume: the checkpoint {checkpoint.name} already holds "
            f"{done} steps and train.steps is {r.train.steps}; run further with "
            f"--set train.steps={done + r.train.steps}",
            err=True,
        )
        raise typer.Exit(code=2)
    for line in changes:
        typer.echo(f"resume changes {line}")
    typer.echo(f"resuming from {checkpoint} (step {done} of {r.train.steps})")
