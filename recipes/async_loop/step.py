"""`async_step`: one step of the asynchronous loop (take fresh groups, save, train,
push with the producer paused); the producer is recipes/async_loop/stream.py."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...common.telemetry import Span
from .. import controller as c
from ..algo.rollouts import apply_failure_policy, rollout_batch, rollout_metrics
from ..empty_steps import train_or_skip
from ..monitoring.offpolicy import offpolicy_metrics
from ..state import Run
from .groups import Group
from .stream import RolloutStream

if TYPE_CHECKING:
    from ..algo.base import RLAlgorithm


class StreamPosition:
    """Stands in for the run's prompt stream once the producer owns it: `state()` is the
    position a checkpoint must save (`RolloutStream.data_state`)."""

    def __init__(self, stream: RolloutStream):
        self.stream = stream

    def state(self) -> dict[str, Any] | None:
        """The position with the samples not trained yet (`data_state(prefixes=True)`)."""
        return self.stream.data_state(prefixes=True)


def async_step(run: Run, algo: RLAlgorithm, step: int) -> tuple[dict[str, float], list[Span]]:
    """One step of the asynchronous loop: take fresh groups → save → train → push (with
    the producer paused). Metrics as `rl_step`'s, plus the off-policy accounting of
    recipes/monitoring/offpolicy.py (`staleness_mean`, `staleness_max`, `staleness_frac/{d}`,
    versions spanned per sample, sample counts that add up), `dropped_stale`
    (samples), `time/wait_rollouts` (the learner
    waiting for fresh groups) and `time/wait_push` (waiting for a round in flight).
    `time/generate` is the wait for fresh groups and `time/score` 0: generation and
    scoring overlap training, only the wait is on the step's critical path."""
    recipe, roles = run.recipe, run.roles
    if run.stream is None:
        run.stream = RolloutStream(run, start_version=step)
        run.prompts = StreamPosition(run.stream)
    t0 = time.time()
    groups, stale, flat = run.stream.take(step)
    counts = run.stream.sample_counts()
    t1 = time.time()
    rollouts = [r for g in groups for r in g.rollouts]
    scores = [s for g in groups for s in g.scores]
    if recipe.monitor.save_rollouts:
        c.save_rollouts(run.run_dir, step, rollouts, scores)
    rewards = apply_failure_policy(scores, rollouts, recipe.on_reward_failure)
    batch = rollout_batch(rollouts, rewards, roles.pad_id)
    stats = train_or_skip(algo, roles.learners, batch, rollouts, rewards, scores, step)
    t_trained = time.time()
    accuracy_of = next((r.name for r in recipe.rewards if r.type == "math"), None)
    quality = rollout_metrics(rollouts, scores, accuracy_of, recipe.monitor.hacking.many_answers)
    trained = {"policy_version": step + 1, **quality, **stats}  # the line of a failed push
    with run.stream.paused(push=True):
        t_push = time.time()
        sync_s = c.push_after_training(roles, recipe, step + 1, trained)
    t_end = time.time()
    telemetry, spans = _telemetry(run, t0, t_end)
    dropped = sum(len(g.rollouts) for g in stale)
    bound = max(run.stream.k, run.stream.token_k or 0)
    accounting = offpolicy_metrics(
        rollouts, step, bound, counts, dropped + sum(len(g.rollouts) for g in flat)
    )
    tokens = sum(len(r.response_ids) for r in rollouts)
    return {
        "policy_version": step + 1,
        "rollout_restarts": roles.counters.rollout_restarts,
        "reward_restarts": roles.counters.reward_restarts,
        **quality,
        **stats,
        **accounting,
        "dropped_stale": float(dropped),
        **_sampler_metrics(run.stream, flat),
        "time/wait_rollouts": t1 - t0,
        "time/wait_push": t_push - t_trained,
        # the step's critical path: generation and scoring run behind training
        "time/generate": t1 - t0,
        "time/score": 0.0,
        "time/weight_sync": sync_s,
        "time/step": t_end - t0,
        "weight_sync_bytes": roles.counters.last_push_bytes,
        "weight_sync_changed_fraction": roles.counters.last_push_changed,
        "rollout_tokens_per_s": tokens / (t_end - t0),
        "weight_sync_fraction": sync_s / (t_end - t0),
        **telemetry,
    }, spans


def _sampler_metrics(stream: RolloutStream, flat: list[Group]) -> dict[str, float]:
    """Dynamic sampling's dropped groups (no signal) at this step; the episode metrics
    of the last episode round scored."""
    out = dict(stream.episode_metrics)
    if stream.dynamic:
        out["dynamic/dropped_groups"] = float(len(flat))
    return out


def _telemetry(run: Run, start: float, end: float) -> tuple[dict[str, float], list[Span]]:
    """Idle fractions and busy seconds of both sides in [start, end], from the workers'
    own spans and the controller's view of each generation request."""
    return c.step_telemetry(run.roles, start, end, [], counted=run.stream.drain_spans(end))
