"""`run(recipe)`: the GRPO training loop, a handful of named calls per step."""

from __future__ import annotations

import time
from pathlib import Path

import ray
from tqdm import tqdm

from posttrain.common.model_registry import resolve_model_path
from posttrain.common.process import quiet_libraries
from posttrain.common.telemetry import Span
from posttrain.recipes import controller as c
from posttrain.recipes.dashboard import DashboardServer
from posttrain.recipes.data import PromptItem, load_prompts, prompt_stream
from posttrain.recipes.grpo import apply_failure_policy, build_train_batch, rollout_metrics
from posttrain.recipes.monitor import StepLog
from posttrain.recipes.ppo import train_ppo
from posttrain.config import Recipe


def run(recipe: Recipe, run_dir: Path, address: str | None = None,
        prompts: list[PromptItem] | None = None) -> list[dict[str, float]]:
    """Train `recipe` end to end; returns the per-step metrics also written to
    `run_dir/metrics.jsonl`. The final policy goes to `run_dir/final` (save_pretrained).

    Raises:
        RecipeError: bad data rows or resources (before any model loads).
        RuntimeError, WeightSyncError, RewardFailure: a role failed; the rollouts and
            metrics of finished steps are kept.
    """
    quiet_libraries()
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts = prompts if prompts is not None else load_prompts(recipe.data)
    batches = prompt_stream(prompts, recipe.train.prompts_per_step, recipe.data.shuffle_seed)
    model_path = str(resolve_model_path(recipe.model.path))
    c.write_manifest(run_dir, recipe, model_path)
    c.init_ray(recipe, address)
    roles, history, log, dash = None, [], StepLog(run_dir, recipe), None
    accuracy_of = next((r.name for r in recipe.rewards if r.type == "math"), None)
    try:
        if recipe.monitor.dashboard_port is not None:
            dash = DashboardServer(run_dir, recipe.monitor.dashboard_port)
            print(f"dashboard: {dash.start()}  (Prometheus: /metrics)", flush=True)
        roles = c.start_roles(recipe, model_path, run_dir)
        bar = tqdm(range(recipe.train.steps), desc=recipe.name, disable=not recipe.monitor.progress)
        for step in bar:
            t0 = time.time()
            rollouts = c.generate(roles, next(batches), recipe, step)
            t1 = time.time()
            rewards, details = c.score(roles, rollouts)
            t2 = time.time()
            if recipe.monitor.save_rollouts:
                c.save_rollouts(run_dir, step, rollouts, rewards, details)
            train_rewards = apply_failure_policy(
                rewards, [r.group_id for r in rollouts], recipe.on_reward_failure,
                [d.get("error") for d in details])
            batch = build_train_batch(rollouts, train_rewards, roles.pad_id,
                                      recipe.grpo.scale_rewards, recipe.grpo.std_eps)
            if recipe.algorithm == "ppo":
                stats = train_ppo(roles.learners, batch, rollouts, train_rewards, recipe, step)
            else:
                stats = c.train_on(roles, batch, recipe, step)
            sync_s = c.push_weights(roles, recipe, version=step + 1)
            t_end = time.time()
            telemetry, spans = c.step_telemetry(roles, t0, t_end,
                                                [Span("reward", 0, "score", t1, t2, step)])
            metrics = {"step": step, "policy_version": step + 1,
                       **rollout_metrics(rollouts, rewards, details, accuracy_of), **stats,
                       "time/generate": t1 - t0, "time/score": t2 - t1,
                       "time/weight_sync": sync_s, "time/step": t_end - t0,
                       "weight_sync_bytes": roles.last_push_bytes,
                       "rollout_tokens_per_s": sum(len(r.response_ids) for r in rollouts)
                       / max(t1 - t0, 1e-9),
                       "weight_sync_fraction": sync_s / (t_end - t0),
                       "score_fraction": (t2 - t1) / (t_end - t0), **telemetry}
            history.append(metrics)
            log.record(step, metrics, spans)
            _report(bar, step, metrics, rewards, details, recipe)
        if recipe.train.save_final:
            ray.get([lw.save_checkpoint.remote(str(run_dir / "final"), recipe.train.steps)
                     for lw in roles.learners])
    finally:
        c.stop_roles(roles)
        ray.shutdown()
        log.close()
        if dash is not None:
            dash.stop()
    return history


def _report(bar: tqdm, step: int, m: dict, rewards: list, details: list, recipe: Recipe) -> None:
    if m["failed_scores"]:
        bar.write(f"step {step}: {m['failed_scores']:.0f} rollouts could not be scored "
                  f"({details[rewards.index(None)].get('error')}); "
                  f"on_reward_failure={recipe.on_reward_failure}")
    bar.set_postfix(reward=f"{m['reward_mean']:.3f}", len=f"{m['response_length_mean']:.0f}",
                    step_s=f"{m['time/step']:.1f}", refresh=False)
