"""The `posttrain` command: run, validate, plan, schema, eval, serve.

Exit codes: 0 success; 2 a bad recipe, bad data or bad input (reported before Ray or
any model starts); 1 a failure during training.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ...common.net import listen_socket
from ...common.process import bf16_note, quiet_logs
from ...config import Recipe, RecipeError
from ..planning.layout import run_layout as _layout
from .checks import (
    check_new_run_or_exit,
    load_or_exit,
    lock_or_exit,
    new_run_dir,
    out_not_a_file_or_exit,
    port_or_exit,
    reward_server_or_exit,
    run_dir_or_exit,
)

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


@app.command()
def validate(recipe: Path, set_: SetOpt = None) -> None:
    """Check a recipe (schema, data rows, model path) without starting anything."""
    r, prompts = load_or_exit(recipe, set_, convert=False)
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
    """Train a recipe end to end, or continue a run with --resume RUN_DIR. One run at a
    time holds the run folder (a second one is refused)."""
    if recipe is None and resume is None:
        msg = "give a recipe (posttrain run RECIPE) or a run to continue (--resume RUN_DIR)"
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(code=2)
    if resume is not None:
        from . import resume as resuming  # imports torch: after the cheap checks

        run_dir, checkpoint = resume, resuming.checkpoint_or_exit(resume)
        r, prompts = load_or_exit(recipe or checkpoint / "recipe.yaml", set_)
    else:
        out_not_a_file_or_exit(out)  # before the recipe's checks convert a model
        r, prompts = load_or_exit(recipe, set_)
        run_dir, checkpoint = new_run_dir(r, out), None
    with lock_or_exit(run_dir):  # before the folder's checks: a run in progress is named
        if checkpoint is not None:
            resuming.check_resume_or_exit(r, checkpoint)
            resuming.check_data_or_exit(r, checkpoint, prompts, accept_data_change)
        else:
            check_new_run_or_exit(run_dir)
        r = port_or_exit(r)
        if checkpoint is None:  # a resume keeps the layout its checkpoint was saved in
            r = _layout(r, prompts)
        typer.echo(f"posttrain: {r.name} ({r.algorithm}) → {run_dir}")
        if (note := bf16_note(r.resources.device, r.model.dtype)) is not None:
            typer.echo(note)
        _train_or_exit(r, run_dir, address, prompts, checkpoint)


def _train_or_exit(
    r: Recipe, run_dir: Path, address: str | None, prompts: list, checkpoint: Path | None
) -> None:
    """Run the loop, then print its summary; a documented stop exits with its code
    (2: bad input, 128 + signal: stopped by a signal, 1: a role failed after a
    checkpoint, a checkpoint could not be written, or `monitor.on_hacking: stop` stopped
    it) and its message."""
    from ..checkpoints import CheckpointFailed
    from ..empty_steps import NothingToTrain
    from ..loop import run as run_loop
    from ..monitoring.evidence import HackingStopped  # heavy imports only after validation
    from ..recovery import LearnerDied, PushFailed, RunStopped

    t0 = time.time()
    try:
        history = run_loop(r, run_dir, address, prompts, resume=checkpoint)
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    except RunStopped as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(code=128 + e.signum) from None
    except (PushFailed, LearnerDied, NothingToTrain, CheckpointFailed, HackingStopped) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None
    from ..monitoring.summary import print_summary

    print_summary(history, run_dir, time.time() - t0)


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
    from ..planning.formulas import HARDWARE

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
    r, prompts = load_or_exit(recipe, set_, convert=False, lengths=False)
    if gpu == "cpu" and (note := bf16_note(r.resources.device, r.model.dtype)) is not None:
        typer.echo(note)
    from ..planning import view as plan_view

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
    cfg, token = reward_server_or_exit(config)
    import uvicorn

    from ...rewards.service import create_app

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
    from ..assess.command import evaluate_target

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


@app.command()
def status(
    run_dir: Path,
    last: Annotated[int, typer.Option(min=1, help="Training steps to show.")] = 10,
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
        from ...service.status_view import print_service_status

        print_service_status(run_dir, typer.echo)
        return
    from ..monitoring.status import print_status

    rows = run_dir_or_exit(run_dir)
    print_status(run_dir, rows, last)
    if advise:
        from ..monitoring.advice import advise_run

        for line in advise_run(run_dir, rows, mtbf).lines:
            typer.echo(line)


@app.command()
def dashboard(
    run_dir: Path,
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: any free port).")] = 8765,
) -> None:
    """Serve the dashboard of a run folder (finished or still running)."""
    run_dir_or_exit(run_dir)
    from ..monitoring.dashboard import DashboardServer

    server = DashboardServer(run_dir, port)
    typer.echo(f"dashboard: {server.start()}  (Ctrl-C to stop)")
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.stop()


@app.command()
def serve(
    config: Annotated[
        Path | None, typer.Option(help="Service configuration YAML (examples/serve.yaml).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="The base model: built-in alias or model folder.")
    ] = None,
    engine: Annotated[str | None, typer.Option(help="Rollout engine: vllm or hf.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one).")] = 8000,
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
    from ...service.cli import flag_overrides
    from ...service.cli import serve as serve_main

    overrides = flag_overrides(model, engine)
    code = serve_main(config, overrides, root, host, port, address, typer.echo)
    if code:
        raise typer.Exit(code=code)


def main() -> None:
    """Console entry point (`posttrain`)."""
    quiet_logs()
    sys.exit(app())
