"""The `posttrain` command: run, validate, plan, schema, eval, serve.

Exit codes: 0 success; 2 a bad recipe, bad data or bad input (reported before Ray or
any model starts); 1 a failure during training.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ..common.net import listen_socket
from ..common.process import bf16_note
from ..config import Recipe, RecipeError
from .algo.teacher import check_teacher_tokenizer
from .data import load_data
from .loading import load_recipe
from .preflight import check_eval_lengths, check_lengths, check_runtime_inputs

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="RL post-training of language models from recipe YAMLs.",
)

SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a recipe key: --set train.steps=2 (value parsed as YAML)."
    ),
]


def _load_or_exit(
    recipe: Path, overrides: list[str] | None, convert: bool = True, lengths: bool = True
) -> tuple[Recipe, list]:
    """The validated recipe and its training data: GRPO / PPO prompts, or DPO and
    reward-model pairs (every data row checked); prompt lengths too unless `lengths` is
    False (`plan` checks them itself, tokenizing once)."""
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
            from .data.chats import check_chats

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
        typer.echo(f"error: {e}", err=True)
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


@app.command()
def validate(recipe: Path, set_: SetOpt = None) -> None:
    """Check a recipe (schema, data rows, model path) without starting anything."""
    r, prompts = _load_or_exit(recipe, set_, convert=False)
    what = {"pairs": "pairs", "chat": "conversations"}.get(r.facts.data, "prompts")
    typer.echo(
        f"ok: {recipe} ({r.algorithm}, {r.train.steps} steps, {len(prompts)} {what}, "
        f"model {r.model.path})"
    )


@app.command()
def schema() -> None:
    """Print the recipe's JSON Schema (point your editor's YAML plugin at it)."""
    typer.echo(json.dumps(Recipe.model_json_schema(), indent=2))


@app.command()
def run(
    recipe: Annotated[
        Path | None,
        typer.Argument(help="Recipe YAML (with --resume: default RUN_DIR's own recipe)."),
    ] = None,
    set_: SetOpt = None,
    out: Annotated[
        Path | None, typer.Option(help="Run folder; default runs/<name>-<time>.")
    ] = None,
    address: Annotated[
        str | None,
        typer.Option(
            help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)."
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Continue RUN_DIR from its newest complete checkpoint (--set may change "
            "train.steps, monitor.*, resources.learner.gpus)."
        ),
    ] = None,
    accept_data_change: Annotated[
        bool,
        typer.Option(
            "--accept-data-change",
            help="With --resume: continue although the training data differs from the "
            "data the checkpoint was made with (its data position then points into the "
            "new data).",
        ),
    ] = False,
) -> None:
    """Train a recipe end to end, or continue a run with --resume RUN_DIR."""
    if resume is not None:
        run_dir, checkpoint = resume, _checkpoint_or_exit(resume)
        r, prompts = _load_or_exit(recipe or checkpoint / "recipe.yaml", set_)
        _check_resume_or_exit(r, checkpoint)
        _check_data_or_exit(r, checkpoint, prompts, accept_data_change)
    else:
        r, prompts, run_dir = _new_run_or_exit(recipe, set_, out)
        checkpoint = None
    r = _port_or_exit(r)
    typer.echo(f"posttrain: {r.name} ({r.algorithm}) → {run_dir}")
    if (note := bf16_note(r.resources.device, r.model.dtype)) is not None:
        typer.echo(note)
    _train_or_exit(r, run_dir, address, prompts, checkpoint)


def _new_run_or_exit(
    recipe: Path | None, set_: list[str] | None, out: Path | None
) -> tuple[Recipe, list, Path]:
    """The recipe, its data and a run folder that holds no run yet (exit 2 otherwise)."""
    from . import checkpoints

    if recipe is None:
        typer.echo(
            "error: give a recipe (posttrain run RECIPE) or a run to continue "
            "(posttrain run --resume RUN_DIR)",
            err=True,
        )
        raise typer.Exit(code=2)
    r, prompts = _load_or_exit(recipe, set_)
    run_dir = out or Path("runs") / f"{r.name}-{time.strftime('%Y%m%d-%H%M%S')}"
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
    return r, prompts, run_dir


def _train_or_exit(
    r: Recipe, run_dir: Path, address: str | None, prompts: list, checkpoint: Path | None
) -> None:
    """Run the loop, then print its summary; a documented stop exits with its code
    (2: bad input, 128 + signal: stopped by a signal, 1: a role failed after a
    checkpoint) and its message."""
    from .empty_steps import NothingToTrain
    from .loop import PushFailed, RunStopped
    from .loop import run as run_loop  # heavy imports only after validation
    from .recovery import LearnerDied

    t0 = time.time()
    try:
        history = run_loop(r, run_dir, address, prompts, resume=checkpoint)
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    except RunStopped as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(code=128 + e.signum) from None
    except (PushFailed, LearnerDied, NothingToTrain) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None
    _summary(history, run_dir, time.time() - t0)


def _port_or_exit(r: Recipe) -> Recipe:
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


def _checkpoint_or_exit(run_dir: Path) -> Path:
    """The newest complete checkpoint of `run_dir`."""
    from . import checkpoints

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
    from . import checkpoints

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


def _check_data_or_exit(r: Recipe, checkpoint: Path, data: list, accept: bool) -> None:
    """Refuse (exit 2) training data that differs from the checkpoint's, unless
    `--accept-data-change`."""
    from . import checkpoints

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


def _check_resume_or_exit(r: Recipe, checkpoint: Path) -> None:
    """Refuse a recipe that changes what a resume cannot; print what it changes."""
    from . import checkpoints

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


@app.command()
def plan(
    recipe: Path,
    gpu: Annotated[
        str,
        typer.Option(help="Accelerator: h100, h200, a100, or cpu (measures this machine first)."),
    ] = "h100",
    mfu: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Assumed model-FLOPs utilisation of training.")
    ] = 0.4,
    nodes: Annotated[
        int | None,
        typer.Option(
            min=1, help="Machines (with --gpus-per-node); the split search uses all their devices."
        ),
    ] = None,
    gpus_per_node: Annotated[int | None, typer.Option(min=1, help="Devices per machine.")] = None,
    recalibrate: Annotated[
        bool,
        typer.Option(
            help="--gpu cpu: measure this machine again instead of reading the cached "
            "calibration (~/.cache/posttrain/calibration)."
        ),
    ] = False,
    set_: SetOpt = None,
) -> None:
    """Predict memory per device, step time, idle fractions and the best rollout:learner
    split of a recipe on GPUs (or, with --gpu cpu, the step on this machine's cores),
    before anything starts."""
    from .planning.formulas import HARDWARE

    if gpu not in (*HARDWARE, "cpu"):
        typer.echo(f"error: --gpu {gpu!r}: give one of {', '.join(HARDWARE)}, cpu", err=True)
        raise typer.Exit(code=2)
    if gpu == "cpu" and (nodes or gpus_per_node):
        typer.echo(
            "error: --nodes / --gpus-per-node plan GPU clusters; --gpu cpu measures "
            "this one machine: drop them or give --gpu h100|h200|a100",
            err=True,
        )
        raise typer.Exit(code=2)
    if (nodes is None) != (gpus_per_node is None):
        typer.echo("error: give --nodes and --gpus-per-node together", err=True)
        raise typer.Exit(code=2)
    r, prompts = _load_or_exit(recipe, set_, convert=False, lengths=False)
    if gpu == "cpu" and (note := bf16_note(r.resources.device, r.model.dtype)) is not None:
        typer.echo(note)
    from .planning import view as plan_view

    plan_view.main(r, prompts, gpu, mfu, nodes, gpus_per_node, recalibrate)


@app.command("serve-rewards")
def serve_rewards(
    config: Path,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free).")] = 9000,
) -> None:
    """Serve built-in and python reward components over HTTP (POST /score).

    Run it on a verifier host; recipes elsewhere point a `type: http` reward at it.
    """
    import yaml
    from pydantic import ValidationError

    from ..config.rewards import RewardServerConfig
    from .loading import format_errors

    try:
        cfg = RewardServerConfig.model_validate(yaml.safe_load(config.read_text()))
    except (OSError, yaml.YAMLError) as e:
        typer.echo(f"error: {config}: {e}", err=True)
        raise typer.Exit(code=2) from None
    except ValidationError as e:
        typer.echo(f"error: {format_errors(e, str(config))}", err=True)
        raise typer.Exit(code=2) from None
    token = os.environ.get(cfg.token_env) if cfg.token_env else None
    if cfg.token_env and not token:
        typer.echo(f"error: {config}: token_env {cfg.token_env} is not set", err=True)
        raise typer.Exit(code=2)
    from .preflight import reward_model_problem

    for i, c in enumerate(cfg.rewards):  # before torch loads anything
        if c.type == "reward_model" and (problem := reward_model_problem(i, c.path)):
            typer.echo(f"error: {config}: {problem}", err=True)
            raise typer.Exit(code=2)
    import uvicorn

    from ..rewards.service import create_app

    try:
        app = create_app([c.model_dump() for c in cfg.rewards], token, cfg.workers)
    except (ValueError, RuntimeError, OSError) as e:  # a missing function, sandbox, model
        typer.echo(f"error: {config}: {e}", err=True)
        raise typer.Exit(code=2) from None
    try:  # bound here so a bad host or a taken port is a clear error, not a traceback;
        # SO_REUSEADDR: a service that crashed comes back on its port at once
        sock = listen_socket(host, port)
    except OSError as e:
        typer.echo(f"error: cannot listen on {host}:{port}: {e}", err=True)
        raise typer.Exit(code=2) from None
    port = sock.getsockname()[1]
    typer.echo(
        f"reward service on http://{host}:{port}/score "
        f"({', '.join(c.name for c in cfg.rewards)}; auth {'on' if token else 'off'})"
    )
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


@app.command("eval")
def eval_(
    target: Annotated[
        str,
        typer.Argument(
            help="A run folder, a checkpoint (RUN_DIR/checkpoints/step_N), a saved policy "
            "(RUN_DIR/final), an adapter folder, or the model alias smollm2-135m-instruct."
        ),
    ],
    recipe: Annotated[
        Path | None,
        typer.Option(
            help="Recipe whose held-out set and rewards to use; default the target's own."
        ),
    ] = None,
    engine: Annotated[
        str | None, typer.Option(help="Rollout engine instead of the recipe's: hf or vllm.")
    ] = None,
    rewards: Annotated[
        Path | None,
        typer.Option(help="YAML list of reward components instead of the recipe's rewards."),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            help="Held-out file instead of the recipe's: prompts (GRPO / PPO) or preference "
            "pairs (DPO / reward model, read in the recipe's data format)."
        ),
    ] = None,
    k: Annotated[
        int | None, typer.Option("-n", "--k", min=1, help="Samples per prompt (pass@k).")
    ] = None,
    reward_model: Annotated[
        Path | None,
        typer.Option(
            "--reward-model",
            help="DPO: also the policy's win rate over the base model under this reward-"
            "model folder.",
        ),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the report (with per-item values) here.")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Keep the samples and any rebuilt model here (default: a temp folder)."),
    ] = None,
    set_: SetOpt = None,
) -> None:
    """Evaluate a trained model on its recipe's held-out set: pass@1, pass@k, mean reward
    and length (GRPO / PPO); pairwise accuracy (reward model); implicit-reward accuracy
    and margin (DPO)."""
    from .assess.command import evaluate_target

    try:
        report = evaluate_target(
            target, recipe, set_, engine, rewards, prompts, k, reward_model, out
        )
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    m = report["metrics"]
    typer.echo(
        f"{report['target']} ({report['kind']}, recipe {report['recipe']}): {report['evaluation']}"
    )
    typer.echo("  " + "   ".join(f"{k} {v:.4g}" for k, v in m.items()))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=1))
        typer.echo(f"  report: {json_out}")


def _run_dir_or_exit(run_dir: Path) -> list[dict]:
    from .monitoring.log import METRICS_FILE, read_jsonl

    if not run_dir.is_dir():
        typer.echo(
            f"error: {run_dir} does not exist; give a run folder (runs/<name>-<time>)", err=True
        )
        raise typer.Exit(code=2)
    rows = read_jsonl(run_dir / METRICS_FILE)
    if not rows and not (run_dir / "recipe.yaml").is_file():
        typer.echo(
            f"error: {run_dir} is not a run folder (no metrics.jsonl or recipe.yaml)", err=True
        )
        raise typer.Exit(code=2)
    return rows


@app.command()
def status(
    run_dir: Path,
    last: Annotated[int, typer.Option(min=1, help="Steps to show.")] = 10,
    advise: Annotated[
        bool,
        typer.Option(
            help="Suggest a rollout:learner split and a checkpoint interval from the measured "
            "spans."
        ),
    ] = False,
    mtbf: Annotated[
        float | None,
        typer.Option(
            min=0.001, help="With --advise: the cluster's mean time between failures, hours."
        ),
    ] = None,
) -> None:
    """Print a table of a run's last steps and its totals (a `posttrain serve` root: its
    sessions, models and, while it runs, its roles and queues)."""
    if (run_dir / "service.json").is_file():
        from ..service.status_view import print_service_status

        print_service_status(run_dir, typer.echo)
        return
    from .monitoring.status import print_status

    rows = _run_dir_or_exit(run_dir)
    print_status(run_dir, rows, last)
    if advise:
        from .monitoring.advice import advise_run

        for line in advise_run(run_dir, rows, mtbf).lines:
            typer.echo(line)


@app.command()
def dashboard(
    run_dir: Path,
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: any free port).")] = 8765,
) -> None:
    """Serve the dashboard of a run folder (finished or still running)."""
    _run_dir_or_exit(run_dir)
    from .monitoring.dashboard import DashboardServer

    server = DashboardServer(run_dir, port)
    typer.echo(f"dashboard: {server.start()}  (Ctrl-C to stop)")
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.stop()


def _summary(history: list[dict[str, float]], run_dir: Path, wall: float) -> None:
    if not history:
        return
    if "sft/assistant_tokens" in history[0]:  # SFT: no rollout timings or rewards
        evals = [h["eval/loss"] for h in history if "eval/loss" in h]
        held = f"   held-out loss {evals[-1]:.4f}" if evals else ""
        typer.echo(
            f"done: {len(history)} steps in {wall:.0f} s\n"
            f"  loss {history[0]['loss']:.4f} → {history[-1]['loss']:.4f}{held}\n"
            f"  metrics: {run_dir / 'metrics.jsonl'}   final policy: {run_dir / 'final'}"
        )
        return
    if "rewards/accuracy" in history[0]:  # DPO
        first, last = history[0], history[-1]
        typer.echo(
            f"done: {len(history)} steps in {wall:.0f} s\n"
            f"  loss {first['loss']:.4f} → {last['loss']:.4f}   reward accuracy "
            f"{first['rewards/accuracy']:.2f} → {last['rewards/accuracy']:.2f}   margin "
            f"{first['rewards/margin']:.3f} → {last['rewards/margin']:.3f}\n"
            f"  metrics: {run_dir / 'metrics.jsonl'}   final policy: {run_dir / 'final'}"
        )
        return
    first, last = history[: min(3, len(history))], history[-min(3, len(history)) :]

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


@app.command()
def serve(
    config: Annotated[
        Path | None,
        typer.Option(
            help="Service configuration YAML (model, rollout, resources, "
            "weight_sync, sessions); see recipes/serve.yaml."
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="The base model: built-in alias or model folder.")
    ] = None,
    engine: Annotated[str | None, typer.Option(help="Rollout engine: vllm or hf.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    root: Annotated[
        Path, typer.Option(help="Folder of the service's sessions, states and samplers.")
    ] = Path("runs/serve"),
    address: Annotated[
        str | None, typer.Option(help="Ray cluster to join (as `posttrain run --address`).")
    ] = None,
) -> None:
    """Start a Tinker-compatible training service on the learner group and rollout
    engines (docs/service.md). The key clients send is $POSTTRAIN_SERVE_TOKEN (it must
    start with 'tml-'), else a new one, printed."""
    from ..service.cli import serve as serve_main

    overrides: dict = {}
    if model is not None:
        overrides["model"] = {"path": model}
    if engine is not None:
        overrides["rollout"] = {"engine": engine}
    code = serve_main(config, overrides, root, host, port, address, typer.echo)
    if code:
        raise typer.Exit(code=code)


def main() -> None:
    """Console entry point (`posttrain`)."""
    sys.exit(app())


if __name__ == "__main__":
    main()
