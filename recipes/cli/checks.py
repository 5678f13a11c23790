"""What `posttrain` checks before Ray or any model starts (the commands in
recipes/cli/__init__.py call these):
the recipe and its data (`load_or_exit`), the dashboard port, and the run folder: a new
run's folder holds no run and can be written, and one run at a time holds it
(`lock_or_exit`).

Each refusal prints one line naming the key or path and the fix, and exits 2
(`typer.Exit`). Light on purpose: `posttrain validate` imports this module, and
nothing here imports torch or Ray at import time.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from typing import IO, Any

import typer

from ...common.net import listen_socket
from ...common.process import quiet_logs
from ...config import Recipe, RecipeError
from ..algo.teacher import check_teacher_tokenizer
from ..data import load_data
from ..loading import load_recipe
from ..preflight import check_eval_lengths, check_lengths, check_runtime_inputs

LOCK_FILE = ".posttrain.lock"


def load_or_exit(
    recipe: Path, overrides: list[str] | None, convert: bool = True, lengths: bool = True
) -> tuple[Recipe, list]:
    """The validated recipe and its training data: GRPO / PPO prompts, or DPO and
    reward-model pairs (every data row checked); prompt lengths too unless `lengths` is
    False (`plan` checks them itself, tokenizing once). Exit 2 on a RecipeError."""
    quiet_logs()  # before a built-in model's conversion imports torchao
    try:
        r = load_recipe(recipe, overrides or [])
        check_runtime_inputs(r)
        check_teacher_tokenizer(r, convert=convert)
        data = load_data(r)
        if data.skipped:
            typer.echo(
                f"data: {data.skipped} rows skipped (their dialogues do not share a prompt)",
                err=True,
            )
        if data.held_out:
            typer.echo(
                f"data: {data.held_out} training prompts equal an evaluation prompt and are "
                "left out of training",
                err=True,
            )
        _eval_schedule_note(r)
        if r.facts.data == "chat" and lengths:  # the template marks every assistant turn
            from ..data.chats import check_chats

            check_chats(r, data.train, convert=convert)
        if not r.facts.uses_rollouts:  # pairs, conversations: no generation to fit
            return r, data.train
        # GRPO / PPO: the longest prompt + max_new_tokens fits (`run` converts a built-in
        # model first, so the check never waits for the first training run)
        if lengths and not check_lengths(r, data.train, convert=convert):
            typer.echo(
                f"note: prompt lengths not checked yet: model.path {r.model.path!r} is "
                "converted on the first `posttrain run`, which checks them before "
                "training",
                err=True,
            )
        if lengths:  # after training's, which names rollout.max_new_tokens first
            check_eval_lengths(r, data.eval, convert=convert)
        return r, data.train
    except RecipeError as e:
        message = str(e)
        if not message.startswith(str(recipe)):  # the schema's errors name it already
            message = f"{recipe}: {message}"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code=2) from None


def _eval_schedule_note(r: Recipe) -> None:
    """Say when `eval.every_steps` is past `train.steps`: only the final policy (and, with
    before_train, the initial one) is evaluated (recipes/evaluation.py `due`)."""
    if r.eval is not None and r.eval.every_steps > r.train.steps:
        typer.echo(
            f"note: eval.every_steps ({r.eval.every_steps}) is past train.steps "
            f"({r.train.steps}): the policy is evaluated after the last step only"
            f"{' (and before the first)' if r.eval.before_train else ''}",
            err=True,
        )


def port_or_exit(r: Recipe) -> Recipe:
    """The recipe with a dashboard port it can take, checked now, not after Ray and the
    models: the default port (8765) taken by another run gives way to any free port (the
    dashboard prints the one it got); a port the recipe or --set names must be free, else
    exit 2 naming the key and the fix."""
    port = r.monitor.dashboard_port
    if not port:
        return r
    try:
        listen_socket("127.0.0.1", port).close()
        return r
    except OSError:
        if "dashboard_port" not in r.monitor.model_fields_set:
            typer.echo(f"dashboard: 127.0.0.1:{port} is in use (another run?); taking a free port")
            monitor = r.monitor.model_copy(update={"dashboard_port": 0})
            return r.model_copy(update={"monitor": monitor})
        typer.echo(
            f"error: monitor.dashboard_port: 127.0.0.1:{port} is in use (another "
            "run?); --set monitor.dashboard_port=0 takes any free port, null "
            "turns the dashboard off",
            err=True,
        )
        raise typer.Exit(code=2) from None


def new_run_dir(r: Recipe, out: Path | None) -> Path:
    """`--out`, else runs/<name>-<time>."""
    return out or Path("runs") / f"{r.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def out_not_a_file_or_exit(out: Path | None) -> None:
    """Exit 2 when `--out` names an existing file (or a path below one): checked before
    the recipe's checks, which may convert a model first."""
    below = next((p for p in [out, *out.parents] if p.exists()), None) if out else None
    if below is not None and not below.is_dir():
        where = "is a file" if below == out else f"is below a file, {below}"
        typer.echo(f"error: --out {out} {where}, not a folder; give a folder", err=True)
        raise typer.Exit(code=2)


def check_new_run_or_exit(run_dir: Path) -> None:
    """A new run's folder holds no run yet (no checkpoint, no metrics.jsonl); exit 2
    naming the resume command otherwise."""
    from .. import checkpoints  # imports torch: `run` only

    if (last := checkpoints.latest(run_dir)) is not None:
        typer.echo(
            f"error: --out {run_dir} holds a run with a checkpoint ({last.name}); "
            f"continue it with: posttrain run --resume {run_dir} (add --set "
            "train.steps=N to run longer), or give a new folder",
            err=True,
        )
        raise typer.Exit(code=2)
    if (run_dir / "metrics.jsonl").exists():
        typer.echo(
            f"error: --out {run_dir} already holds a run (metrics.jsonl); give a "
            "new folder or remove that one",
            err=True,
        )
        raise typer.Exit(code=2)


def lock_or_exit(run_dir: Path) -> IO[str]:
    """Create `run_dir` if needed and hold an exclusive lock on it (`fcntl.flock` on
    RUN_DIR/.posttrain.lock) for as long as the returned file stays open: the run's
    life, as the CLI keeps it until the process ends (the kernel releases it then, even
    on kill -9). Exit 2 when the folder cannot be written (naming the OS's reason) or
    another process holds the lock (naming its pid): two runs in one folder would
    interleave their metrics, rollouts and checkpoints."""
    lock = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        f = open(lock, "a+")  # noqa: SIM115 (held open for the run's life)
    except OSError as e:
        typer.echo(
            f"error: run folder {run_dir}: cannot write there ({e.strerror}); give a "
            "folder you can write with --out NEW_DIR (or fix its permissions)",
            err=True,
        )
        raise typer.Exit(code=2) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        typer.echo(
            f"error: run folder {run_dir} is in use by another posttrain run (pid "
            f"{holder}); wait for it to end, stop it, or give another --out",
            err=True,
        )
        raise typer.Exit(code=2) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def reward_server_or_exit(config: Path) -> tuple[Any, str | None]:
    """`posttrain serve-rewards`: the validated `RewardServerConfig` of `config` and its
    token (None: no auth), with every reward-model folder checked before torch loads
    anything; exit 2 naming the file and the problem otherwise."""
    from pydantic import ValidationError

    from ...config import RecipeError
    from ...config.rewards import RewardServerConfig
    from ...config.yamlfile import read_yaml
    from ..loading import format_errors

    try:
        tree = read_yaml(config)
        if isinstance(tree, list):  # the rewards list alone
            raise RecipeError(
                f"{config}: a list at the top level; a reward server's file is a mapping: "
                "put the list under `rewards:` (see docs/rewards.md)"
            )
        cfg = RewardServerConfig.model_validate(tree)
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    except ValidationError as e:
        typer.echo(f"error: {format_errors(e, str(config))}", err=True)
        raise typer.Exit(code=2) from None
    token = os.environ.get(cfg.token_env) if cfg.token_env else None
    if cfg.token_env and not token:
        typer.echo(f"error: {config}: token_env {cfg.token_env} is not set", err=True)
        raise typer.Exit(code=2)
    from ..preflight import reward_model_problem

    for i, c in enumerate(cfg.rewards):  # before torch loads anything
        if c.type == "reward_model" and (problem := reward_model_problem(i, c.path)):
            typer.echo(f"error: {config}: {problem}", err=True)
            raise typer.Exit(code=2)
    return cfg, token


def run_dir_or_exit(run_dir: Path) -> list[dict]:
    """The metrics rows of a run folder (`status`, `dashboard`); exit 2 when it is not one."""
    from ..monitoring.log import METRICS_FILE, read_jsonl

    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "does not exist"
        typer.echo(
            f"error: {run_dir} {what}; give a run folder (runs/<name>-<time>, or --out's)",
            err=True,
        )
        raise typer.Exit(code=2)
    rows = read_jsonl(run_dir / METRICS_FILE)
    if not rows and not (run_dir / "recipe.yaml").is_file():
        typer.echo(
            f"error: {run_dir} is not a run folder (no metrics.jsonl or recipe.yaml)", err=True
        )
        raise typer.Exit(code=2)
    return rows
