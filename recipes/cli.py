"""The `posttrain` command: run, validate, schema.

Exit codes: 0 success; 2 a bad recipe or bad input (reported before Ray or any model
starts); 1 a failure during training.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from recipes.data import PromptItem, load_prompts
from recipes.schema import Recipe, RecipeError, check_runtime_inputs, load_recipe

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RL post-training of language models from recipe YAMLs.")

SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Override a recipe key: --set train.steps=2 (value parsed as YAML).")]


def _load_or_exit(recipe: Path, overrides: list[str] | None) -> tuple[Recipe, list[PromptItem]]:
    """The validated recipe and its training prompts (every data row checked)."""
    try:
        r = load_recipe(recipe, overrides or [])
        check_runtime_inputs(r)
        return r, load_prompts(r.data)
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None


@app.command()
def validate(recipe: Path, set_: SetOpt = None) -> None:
    """Check a recipe (schema, data rows, model path) without starting anything."""
    r, prompts = _load_or_exit(recipe, set_)
    typer.echo(f"ok: {recipe} ({r.algorithm}, {r.train.steps} steps, {len(prompts)} prompts, "
               f"model {r.model.path})")


@app.command()
def schema() -> None:
    """Print the recipe's JSON Schema (point your editor's YAML plugin at it)."""
    typer.echo(json.dumps(Recipe.model_json_schema(), indent=2))


@app.command()
def run(
    recipe: Path,
    set_: SetOpt = None,
    out: Annotated[
        Path | None, typer.Option(help="Run folder; default runs/<name>-<time>.")
    ] = None,
    address: Annotated[str | None, typer.Option(
        help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster).")] = None,
) -> None:
    """Train a recipe end to end."""
    r, prompts = _load_or_exit(recipe, set_)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local folders; never a hub
    run_dir = out or Path("runs") / f"{r.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (run_dir / "metrics.jsonl").exists():
        typer.echo(f"error: --out {run_dir} already holds a run (metrics.jsonl); give a new "
                   "folder or remove that one", err=True)
        raise typer.Exit(code=2)
    typer.echo(f"posttrain: {r.name} ({r.algorithm}) → {run_dir}")
    from recipes.loop import run as run_loop  # heavy imports only after validation

    t0 = time.time()
    try:
        history = run_loop(r, run_dir, address, prompts)
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    _summary(history, run_dir, time.time() - t0)


@app.command("serve-rewards")
def serve_rewards(
    config: Path,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 9000,
) -> None:
    """Serve built-in and python reward components over HTTP (POST /score), e.g. on a
    verifier host; recipes elsewhere point a `type: http` reward at it."""
    import yaml
    from pydantic import ValidationError

    from recipes.reward_specs import RewardServerConfig

    try:
        cfg = RewardServerConfig.model_validate(yaml.safe_load(config.read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as e:
        typer.echo(f"error: {config}: {e}", err=True)
        raise typer.Exit(code=2) from None
    token = os.environ.get(cfg.token_env) if cfg.token_env else None
    if cfg.token_env and not token:
        typer.echo(f"error: {config}: token_env {cfg.token_env} is not set", err=True)
        raise typer.Exit(code=2)
    import uvicorn

    from rewards.service import create_app

    try:
        app = create_app([c.model_dump() for c in cfg.rewards], token, cfg.workers)
    except (ValueError, RuntimeError) as e:  # a missing function or sandbox
        typer.echo(f"error: {config}: {e}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"reward service on http://{host}:{port}/score "
               f"({', '.join(c.name for c in cfg.rewards)}; auth {'on' if token else 'off'})")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def _summary(history: list[dict[str, float]], run_dir: Path, wall: float) -> None:
    if not history:
        return
    first, last = history[: min(3, len(history))], history[-min(3, len(history)):]

    def mean(rows: list[dict[str, float]], key: str) -> float:
        return sum(h[key] for h in rows) / len(rows)

    keys = ["generate", "score", "logprobs", "train", "weight_sync"]
    split = "  ".join(f"{k} {mean(history, 'time/' + k):.1f}s" for k in keys)
    typer.echo(
        f"done: {len(history)} steps in {wall:.0f} s\n"
        f"  reward mean, first {len(first)} steps: {mean(first, 'reward_mean'):.3f}   "
        f"last {len(last)}: {mean(last, 'reward_mean'):.3f}\n"
        f"  step time {mean(history, 'time/step'):.1f}s = {split}\n"
        f"  idle fraction: rollout {mean(history, 'rollout_idle_fraction'):.2f}  "
        f"learner {mean(history, 'learner_idle_fraction'):.2f}\n"
        f"  metrics: {run_dir / 'metrics.jsonl'}   final policy: {run_dir / 'final'}"
    )


def main() -> None:
    """Console entry point (`posttrain`)."""
    sys.exit(app())


if __name__ == "__main__":
    main()
