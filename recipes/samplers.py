"""How a synchronous RL step gets its scored samples, chosen once per run
(`pick_sampler`): plain single-turn rollouts, DAPO's dynamic sampling, or multi-turn /
agent episodes. Each sampler generates and scores one step's samples and writes the
step's rollouts file (`monitor.save_rollouts`), so the step itself reads
sample → batch → train → push.

Concurrency: a sampler runs on the controller's thread between two weight pushes; the
engines hold `policy_version = step` throughout (the asynchronous loop,
recipes/async_loop/, samples through its own `RolloutStream` instead).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ..actors.rollout import Rollout
from ..config import Recipe
from ..rewards.protocol import Score
from . import controller as c
from .algo.dynamic import sample_with_signal
from .episodes.step import add_environment_rewards, episodes_enabled, generate_episodes
from .state import Run


@dataclass
class Sampled:
    """One step's samples to train on, each with its `Score` (same order), and how long
    generating and scoring took.

    Attributes:
        rollouts, scores: what the step trains on (dynamic sampling: the groups with
            signal only; every round's groups went to the rollout file).
        metrics: the sampler's own metrics (episode or dynamic-sampling counts).
        t_start, t_generated, t_scored: wall-clock seconds (time.time()) at the start,
            after generation and after scoring; dynamic sampling interleaves both, so
            its generation span covers scoring too.
    """

    rollouts: list[Rollout]
    scores: list[Score]
    t_start: float
    t_generated: float
    t_scored: float
    metrics: dict[str, float] = field(default_factory=dict)


class Sampler(Protocol):
    def sample(self, run: Run, step: int) -> Sampled:
        """Generate and score step `step`'s samples and save its rollouts file."""
        ...


def _save(run: Run, step: int, rollouts: list[Rollout], scores: list[Score]) -> None:
    if run.recipe.monitor.save_rollouts:
        c.save_rollouts(run.run_dir, step, rollouts, scores)


class PlainSampler:
    """`samples_per_prompt` single-turn rollouts of the next `prompts_per_step` prompts,
    scored by the reward service."""

    def sample(self, run: Run, step: int) -> Sampled:
        t0 = time.time()
        rollouts = c.generate(run.roles, next(run.prompts), run.recipe, step)
        t1 = time.time()
        scores = c.score(run.roles, rollouts)
        t2 = time.time()
        _save(run, step, rollouts, scores)
        return Sampled(rollouts, scores, t0, t1, t2)


class DynamicSampler:
    """DAPO's dynamic sampling (recipes/algo/dynamic.py): rounds of generate + score
    until the step has `prompts_per_step` groups with signal (all its time counts as
    generation)."""

    def sample(self, run: Run, step: int) -> Sampled:
        recipe, roles = run.recipe, run.roles
        t0 = time.time()
        got = sample_with_signal(
            run.prompts,
            lambda prompts, r: c.generate(roles, prompts, recipe, step, r),
            lambda rollouts: c.score(roles, rollouts),
            recipe.train.prompts_per_step,
            recipe.grpo.max_rounds,
        )
        t1 = time.time()
        _save(run, step, got.all_rollouts, got.all_scores)
        metrics = {
            "dynamic/dropped_groups": float(got.dropped_groups),
            "dynamic/rounds": float(got.rounds),
        }
        return Sampled(got.rollouts, got.scores, t0, t1, t1, metrics)


class EpisodeSampler:
    """Multi-turn or black-box agent episodes (recipes/episodes/step.py), scored by the
    reward service plus the environment's own rewards."""

    def sample(self, run: Run, step: int) -> Sampled:
        t0 = time.time()
        rollouts, metrics = generate_episodes(
            run.roles, next(run.prompts), run.recipe, run.model_path, step, run.run_dir
        )
        t1 = time.time()
        scores = add_environment_rewards(rollouts, c.score(run.roles, rollouts))
        t2 = time.time()
        _save(run, step, rollouts, scores)
        return Sampled(rollouts, scores, t0, t1, t2, metrics)


def pick_sampler(recipe: Recipe) -> Sampler:
    """The run's sampler, chosen once: dynamic sampling (`grpo.dynamic_sampling`),
    episodes (`rollout.max_turns > 1` or `rollout.agent`), else plain rollouts. The
    schema refuses dynamic sampling together with episodes."""
    if recipe.grpo.dynamic_sampling:
        return DynamicSampler()
    if episodes_enabled(recipe):
        return EpisodeSampler()
    return PlainSampler()
