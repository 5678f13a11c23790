"""`run(recipe)`: one run lifecycle for every algorithm (start the roles, maybe resume,
step, log, checkpoint, save, stop), and `rl_step`, the GRPO/PPO step as a handful of
named calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from ..actors.rollout import Rollout
from ..common.model_registry import resolve_model_path
from ..common.process import quiet_libraries
from ..common.telemetry import Span
from ..config import Recipe
from ..rewards.protocol import Score, is_finite_number
from ..weightsync import WeightSyncError
from . import checkpoints
from . import controller as c
from .algo import Algorithm, PairAlgorithm, RLAlgorithm, algorithm_for
from .algo.rollouts import apply_failure_policy, rollout_batch, rollout_metrics
from .algo.teacher import check_teacher_tokenizer
from .data import load_data, prompt_stream
from .empty_steps import EmptySteps, train_or_skip
from .evaluation import due, evaluate, load_eval_prompts
from .monitoring.advisories import advise, console_lines
from .monitoring.dashboard import DashboardServer
from .monitoring.evidence import guard as on_hacking
from .monitoring.evidence import watch
from .monitoring.log import StepLog
from .recovery import (
    STEP_ERRORS,
    LearnerRecovery,
    PushFailed,  # noqa: F401 (re-exported: callers catch loop.PushFailed)
    RunStopped,
    StopOnSignal,
    stop_after_failed_push,
)
from .samplers import Sampled, pick_sampler
from .state import Run


def run(
    recipe: Recipe,
    run_dir: Path,
    address: str | None = None,
    data: list[Any] | None = None,
    resume: Path | None = None,
) -> list[dict[str, float]]:
    """Train `recipe` end to end; returns the per-step metrics also written to
    `run_dir/metrics.jsonl`. The final policy goes to `run_dir/final` (save_pretrained),
    training checkpoints to `run_dir/checkpoints` (recipes/checkpoints.py): every
    `train.checkpoint_every` steps, at the end, and when SIGTERM or Ctrl-C arrives (the
    current step finishes first, then `RunStopped` is raised).

    Args:
        data: the training data already loaded and checked (prompts, or pairs for DPO);
            default: loaded from `recipe.data`.
        resume: a complete checkpoint folder of `run_dir` to continue from (its learner
            state, controller RNGs, data position and policy_version); steps logged after
            it are dropped from the logs (once it has loaded: a resume that fails keeps
            them) and run again.

    Raises:
        RecipeError: bad data rows or resources, or a distillation teacher whose
            tokenizer differs from the student's (before any model loads).
        RuntimeError, WeightSyncError, RewardFailure: a role failed; the rollouts and
            metrics of finished steps are kept.
        RunStopped: a signal stopped the run after a checkpoint.
        PushFailed: a weight push failed twice; stopped after a checkpoint.
        NothingToTrain: `train.max_empty_steps` steps in a row had nothing to train on
            (recipes/empty_steps.py); stopped after a checkpoint.
        LearnerDied: a learner rank died and `train.max_restarts` allows no restart
            (recipes/recovery.py; with restarts left the learner group restarts from the
            newest checkpoint and the steps after it run again).
    """
    quiet_libraries()
    run_dir.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = load_data(recipe)[0]
    eval_prompts = load_eval_prompts(recipe)
    check_teacher_tokenizer(recipe, convert=True)  # distillation: before any model loads
    algo = algorithm_for(recipe)
    model_path = str(resolve_model_path(recipe.model.path))
    saved = checkpoints.read_state(resume) if resume is not None else None
    c.write_manifest(run_dir, recipe, model_path)
    # a resume drops the steps logged after its checkpoint only once that has loaded
    roles, log, dash, state = None, StepLog(run_dir, recipe), None, None
    signals = ExitStack()
    try:
        c.init_ray(recipe, address, rollout=algo.uses_rollouts)
        starting = signals.enter_context(StopOnSignal(starting=True))  # after ray.init
        dash = _start_dashboard(run_dir, recipe)
        roles = c.start_roles(
            recipe,
            algo,
            model_path,
            run_dir,
            resume_from=str(resume / "learner") if resume else None,
        )
        state = Run(recipe, run_dir, model_path, roles, data, eval_prompts=eval_prompts)
        _prepare(state, algo, resume, saved, log)
        starting.stop_if_signalled(run_dir, saved["step"] if saved else 0)
        history = _train(state, algo, log, saved["step"] if saved else 0)
        if recipe.train.save_final:
            ray.get(
                [
                    lw.save_checkpoint.remote(str(run_dir / "final"), recipe.train.steps)
                    for lw in roles.learners
                ]
            )
    finally:
        if state is not None and state.stream is not None:
            state.stream.close()
        c.stop_roles(roles)  # a verifiers v1 environment's drivers among them
        ray.shutdown()
        log.close()
        if dash is not None:
            dash.stop()
        signals.close()
    return history


def _start_dashboard(run_dir: Path, recipe: Recipe) -> DashboardServer | None:
    """The live dashboard of the run folder, when `monitor.dashboard_port` asks for one."""
    if recipe.monitor.dashboard_port is None:
        return None
    dash = DashboardServer(run_dir, recipe.monitor.dashboard_port)
    print(f"dashboard: {dash.start()}  (Prometheus: /metrics)", flush=True)
    return dash


def _prepare(
    run: Run, algo: Algorithm, resume: Path | None, saved: dict[str, Any] | None, log: StepLog
) -> None:
    """What the first step needs once the roles run: the sampler and the prompt stream
    (from the checkpoint's position on a resume), the algorithm's own preparation, and
    on a resume the checkpoint's policy on every engine and the logs rewound to it."""
    recipe = run.recipe
    if algo.uses_rollouts:
        run.sampler = pick_sampler(recipe)
        run.prompts = prompt_stream(
            run.data,
            recipe.train.prompts_per_step,
            recipe.data.shuffle_seed,
            saved and saved["data"],
        )
    algo.prepare(run)
    if resume is not None and saved is not None:
        _resume(run, algo, resume, saved["policy_version"])
        log.rewind(saved["step"])


def _train(run: Run, algo: Algorithm, log: StepLog, start: int) -> list[dict[str, Any]]:
    """Steps `start` to `train.steps` (with the evaluations due, advisories, logs and
    checkpoints), then the final evaluation; returns the steps' metrics. A dead learner
    rank restarts the group or stops (`LearnerRecovery`); a twice-failed push, a signal
    or too many empty steps stop after a checkpoint."""
    recipe, history = run.recipe, []
    bar = tqdm(
        desc=recipe.name,
        initial=start,
        total=recipe.train.steps,
        disable=not recipe.monitor.progress,
    )
    recovery = LearnerRecovery(run, algo, log)
    step_fn = pick_step(algo)
    empty = EmptySteps(recipe.train.max_empty_steps)
    step = start
    with StopOnSignal() as stop:
        while step < recipe.train.steps:
            evaluated = _eval_if_due(run, step)
            if evaluated:  # the bar's rate and ETA count training steps, not evaluations
                bar.unpause()
            try:
                metrics, spans = step_fn(run, algo, step)
            except WeightSyncError as e:  # the step trained if it got to its push: log it
                if isinstance(e, c.StepPushFailed):
                    restarts = run.roles.counters.learner_restarts
                    metrics = {"step": step, **e.metrics, **evaluated, "learner_restarts": restarts}
                    log.record(step, {**metrics, "weight_push_failed": 1}, [])
                raise stop_after_failed_push(run, algo, step, e) from e
            except STEP_ERRORS as e:  # a dead learner rank: restart the group or stop
                step = bar.n = recovery.after_error(step, e)
                history[:] = [m for m in history if m["step"] < step]
                continue
            restarts = run.roles.counters.learner_restarts
            metrics = {"step": step, **metrics, **evaluated, "learner_restarts": restarts}
            firings, started = watch(history, metrics, recipe.monitor.hacking, run.run_dir)
            advise(history, metrics, recipe, [f.advisory for f in firings])
            history.append(metrics)
            log.record(step, metrics, spans)
            _report(bar, metrics)
            bar.update(1)
            step += 1
            _checkpoint_if_due(run, algo, step, stop.signum)
            save = partial(checkpoints.save_run, run, algo, step)
            on_hacking(recipe.monitor.on_hacking, started, step, run.run_dir, save)
            empty.after_step(run, algo, step - 1, metrics)  # NothingToTrain at the limit
        bar.close()
        final = _eval_if_due(run, recipe.train.steps)
        if final:
            row = {"step": recipe.train.steps, **final}
            _heldout_at_end(run, history, row)
            log.record(recipe.train.steps, row, [])
    return history


def _heldout_at_end(run: Run, history: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """The reward-hacking monitors once more with the final evaluation's `row` (the
    held-out trend gains its last point); its firings, if any, go into the row's
    `advisories` and those that start here are printed."""
    firings, _ = watch(history, row, run.recipe.monitor.hacking, run.run_dir)
    if firings:
        row["advisories"] = [f.advisory for f in firings]
    for line in console_lines([*history, row]):  # those that start at this row
        tqdm.write(line)


def _checkpoint_if_due(run: Run, algo: Algorithm, done: int, signum: int | None) -> None:
    """A checkpoint after `done` steps when one is due (every `train.checkpoint_every`,
    the last step, or a signal); raises RunStopped after it on a signal."""
    t = run.recipe.train
    if (
        done == t.steps
        or signum is not None
        or (t.checkpoint_every and done % t.checkpoint_every == 0)
    ):
        folder = checkpoints.save_run(run, algo, done)
        tqdm.write(f"checkpoint: {folder}")
    if signum is not None and done < t.steps:
        raise RunStopped(run.run_dir, done, signum)


def _resume(run: Run, algo: Algorithm, checkpoint: Path, version: int) -> None:
    """Continue the controller's RNGs and put the checkpoint's policy on every engine
    as `version` (the learners loaded it at setup)."""
    checkpoints.restore_controller_rng(checkpoint)
    if algo.uses_rollouts:
        c.push_weights(run.roles, run.recipe, version)
        ray.get([a.drain_spans.remote() for a in run.roles.rollout + run.roles.learners])
    print(f"resumed from {checkpoint} (policy_version {version})", flush=True)


StepFn = Callable[[Run, Any, int], tuple[dict[str, float], list[Span]]]


def pick_step(algo: Algorithm) -> StepFn:
    """The run's step, chosen once: the rollout step (`rl_step`, or `async_step` when
    `train.max_staleness` ≥ 1 lets generation run ahead of training) for an
    `RLAlgorithm`, the pair step (the algorithm's own `step`) for a `PairAlgorithm`.

    Raises:
        TypeError: an algorithm object of neither kind.
    """
    if isinstance(algo, RLAlgorithm):
        if algo.recipe.train.max_staleness:
            from .async_loop import async_step

            return async_step
        return rl_step
    if isinstance(algo, PairAlgorithm):
        return lambda run, a, step: a.step(run, step)
    raise TypeError(f"{type(algo).__name__} is neither an RLAlgorithm nor a PairAlgorithm")


def rl_step(run: Run, algo: RLAlgorithm, step: int) -> tuple[dict[str, float], list[Span]]:
    """One synchronous, on-policy step: sample (generate + score, with the run's sampler)
    → batch → train (advantages and optimizer steps) → push, and every engine holds
    `policy_version = step + 1` before the next generate. The step's rollouts and scores
    reach disk before training."""
    recipe, roles = run.recipe, run.roles
    got = run.sampler.sample(run, step)
    rewards = apply_failure_policy(got.scores, got.rollouts, recipe.on_reward_failure)
    batch = rollout_batch(got.rollouts, rewards, roles.pad_id)
    stats = train_or_skip(algo, roles.learners, batch, got.rollouts, rewards, got.scores, step)
    quality = _quality(recipe, got.rollouts, got.scores, step)
    trained = {"policy_version": step + 1, **_restarts(roles), **quality, **got.metrics, **stats}
    sync_s = c.push_after_training(roles, recipe, step + 1, trained)
    t_end = time.time()
    score_span = Span("reward", 0, "score", got.t_generated, got.t_scored, step)
    telemetry, spans = c.step_telemetry(roles, got.t_start, t_end, [score_span])
    return {
        **trained,
        **_step_times(got, sync_s, t_end),
        "weight_sync_bytes": roles.counters.last_push_bytes,
        "weight_sync_changed_fraction": roles.counters.last_push_changed,
        **telemetry,
    }, spans


def _restarts(roles: c.Roles) -> dict[str, int]:
    return {
        "rollout_restarts": roles.counters.rollout_restarts,
        "reward_restarts": roles.counters.reward_restarts,
    }


def _quality(recipe: Recipe, rollouts: list[Rollout], scores: list[Score], step: int) -> dict:
    """The step's rollout metrics (`rollout_metrics`); says on the console when some
    rollouts could not be scored."""
    accuracy_of = next((r.name for r in recipe.rewards if r.type == "math"), None)
    quality = rollout_metrics(rollouts, scores, accuracy_of, recipe.monitor.hacking.many_answers)
    if quality["failed_scores"]:
        first = next(s for s in scores if not is_finite_number(s.reward))
        why = first.error or f"reward {first.reward!r} is not finite in float32"
        tqdm.write(
            f"step {step}: {quality['failed_scores']:.0f} rollouts could not be scored "
            f"({why}); on_reward_failure={recipe.on_reward_failure}"
        )
    return quality


def _step_times(got: Sampled, sync_s: float, t_end: float) -> dict[str, float]:
    """Seconds of the step's phases and their shares of the step."""
    step_s = t_end - got.t_start
    generate_s, score_s = got.t_generated - got.t_start, got.t_scored - got.t_generated
    tokens = sum(len(r.response_ids) for r in got.rollouts)
    return {
        "time/generate": generate_s,
        "time/score": score_s,
        "time/weight_sync": sync_s,
        "time/step": step_s,
        "rollout_tokens_per_s": tokens / max(generate_s, 1e-9),
        "weight_sync_fraction": sync_s / step_s,
        "score_fraction": score_s / step_s,
    }


def _eval_if_due(run: Run, version: int) -> dict[str, Any]:
    """Evaluate policy `version` (the engines hold it) when `eval` makes it due; its
    metrics (and `time/eval`), else {}. Printed on the console."""
    if not run.eval_prompts or not due(run.recipe, version):
        return {}
    t0 = time.time()
    # k ≥ 1: no generation round (the engines hold `version`) and no scoring call (one
    # reward client, one restart path) runs beside the evaluation
    with run.stream.paused(scoring=True) if run.stream is not None else nullcontext():
        m = evaluate(run.roles, run.recipe, run.eval_prompts, run.run_dir, version, run.model_path)
    m["time/eval"] = time.time() - t0
    tqdm.write(
        f"eval of policy {version}: pass@1 {m['eval/pass@1']:.3f}  pass@{m['eval/k']:.0f} "
        f"{m['eval/pass@k']:.3f}  avg@{m['eval/k']:.0f} {m['eval/avg@k']:.3f}  "
        f"({m['eval/prompts']:.0f} prompts, {m['time/eval']:.1f} s)"
    )
    return m


def _report(bar: tqdm, m: dict[str, Any]) -> None:
    """The progress bar's postfix: reward and length for RL steps, loss for DPO."""
    if "reward_mean" in m:
        bar.set_postfix(
            reward=f"{m['reward_mean']:.3f}",
            len=f"{m['response_length_mean']:.0f}",
            step_s=f"{m['time/step']:.1f}",
            refresh=False,
        )
    else:
        bar.set_postfix(loss=f"{m['loss']:.4f}", step_s=f"{m['time/step']:.1f}", refresh=False)
