"""Evaluation during training (`eval:`): held-out prompts sampled on the rollout
engines between steps, scored with the recipe's rewards, never trained on.

`pass_at_k` and `eval_metrics` are pure; `evaluate` runs one evaluation and writes its
samples to `RUN_DIR/eval/step_NNNNN.jsonl` (NNNNN = the policy version evaluated, 0 =
before training), apart from the training rollouts in `RUN_DIR/rollouts/`.

Limits: a sample passes when its reward reaches `eval.pass_threshold`, so pass@k means
"solved" only for 0/1 verifiers (math); a sample that could not be scored counts as a
fail. n = k samples per prompt, so pass@k here is "any of the k passed". A recipe with
episodes (`rollout.max_turns > 1`, tools, an agent) is evaluated on episodes, as it
trains: each of the k samples is a whole episode, scored on its last model turn plus the
environment's reward, with the episode metrics (tool calls, turns) under `eval/episode/`.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import ray

from ..actors.rollout import Rollout, SamplingSettings
from ..config import Recipe
from ..rewards.protocol import Score
from . import controller as c
from .data import load_eval_prompts  # noqa: F401  (re-exported: the loop imports it here)
from .data.items import PromptItem
from .episodes.step import add_environment_rewards, episodes_enabled, generate_episodes


def pass_at_k(n: int, c_: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. 2021 (eq. 1) from n samples of which c_ passed:
    1 − C(n−c, k)/C(n, k), computed as 1 − Π_{i=n−c+1..n} (1 − k/i) (no big binomials).

    Raises:
        ValueError: k > n, or c_ outside 0..n.
    """
    if not 0 <= c_ <= n or not 0 < k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 0 < k <= n; got n={n} c={c_} k={k}")
    if n - c_ < k:
        return 1.0
    prod = 1.0
    for i in range(n - c_ + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def eval_metrics(
    rollouts: list[Rollout], scores: list[Score], k: int, threshold: float
) -> dict[str, float]:
    """`eval/pass@1`, `eval/pass@k`, `eval/avg@k` (mean reward) over prompts, and the
    same per reward component (`eval/pass@k/NAME`, ...); `eval/k`, `eval/prompts`,
    `eval/length_mean` (response tokens per sample)."""
    values: dict[str, dict[str, list[float | None]]] = {"": {}}
    for r, s in zip(rollouts, scores, strict=True):
        values[""].setdefault(r.group_id, []).append(s.reward)
        for name, v in s.details.items():
            if "." not in name and isinstance(v, int | float):
                values.setdefault(f"/{name}", {}).setdefault(r.group_id, []).append(float(v))
    out = {
        "eval/k": float(k),
        "eval/prompts": float(len(values[""])),
        "eval/length_mean": statistics.fmean(len(r.response_ids) for r in rollouts),
    }
    for suffix, groups in values.items():
        p1, pk, avg = [], [], []
        for vals in groups.values():
            passed = sum(v is not None and v >= threshold for v in vals)
            p1.append(pass_at_k(len(vals), passed, 1))
            pk.append(pass_at_k(len(vals), passed, min(k, len(vals))))
            avg.append(statistics.fmean(0.0 if v is None else v for v in vals))
        out[f"eval/pass@1{suffix}"] = statistics.fmean(p1)
        out[f"eval/pass@k{suffix}"] = statistics.fmean(pk)
        out[f"eval/avg@k{suffix}"] = statistics.fmean(avg)
    return out


def due(recipe: Recipe, version: int) -> bool:
    """Whether policy `version` is evaluated: every `eval.every_steps`-th, the final one
    (`train.steps`, as verl's last-step validation: a schedule past the run, or one that
    does not divide it, still scores the trained policy) and, with `before_train`, 0."""
    e = recipe.eval
    if e is None:
        return False
    if version == 0:
        return e.before_train
    return version % e.every_steps == 0 or version == recipe.train.steps


def evaluate(
    roles: c.Roles,
    recipe: Recipe,
    prompts: list[PromptItem],
    run_dir: Path,
    version: int,
    model_path: str,
) -> dict[str, Any]:
    """Sample, score and log one evaluation of the policy the engines hold (`version`,
    loaded from `model_path`: its tokenizer renders episodes); its engine spans are
    dropped (they belong to no training step)."""
    return sample_and_score(roles, recipe, prompts, run_dir, version, model_path)[0]


def sample_and_score(
    roles: c.Roles,
    recipe: Recipe,
    prompts: list[PromptItem],
    run_dir: Path,
    version: int,
    model_path: str,
) -> tuple[dict[str, Any], list[Rollout], list[Score]]:
    """`evaluate`'s metrics with the rollouts and scores they come from (`posttrain eval`
    compares them per prompt). Needs `recipe.eval`. With episodes, k episodes per prompt
    (`episodes.step.generate_episodes` at the evaluation's sampling settings), their
    metrics under `eval/episode/` and `eval/episode/tool_call_rate` (the share of
    episodes with at least one tool call)."""
    e = recipe.eval
    assert e is not None  # callers pass recipes with an eval block (loop: `due`)
    sampling = SamplingSettings(
        n=e.k,
        max_new_tokens=e.max_new_tokens or recipe.rollout.max_new_tokens,
        temperature=e.temperature,
        top_p=recipe.rollout.top_p,
        seed=e.seed,
        stop=tuple(recipe.rollout.stop),
    )
    episodes: dict[str, float] = {}
    if episodes_enabled(recipe):
        rollouts, got = generate_episodes(
            roles, prompts, recipe, model_path, version, run_dir, n=e.k, sampling=sampling, tag="e"
        )
        scores = add_environment_rewards(rollouts, c.score(roles, rollouts))
        episodes = {f"eval/{k}": v for k, v in got.items()}
        if "episode/episodes_with_tool_call" in got:  # an agent's tools are its own program's
            episodes["eval/episode/tool_call_rate"] = got["episode/episodes_with_tool_call"] / max(
                len(rollouts), 1
            )
    else:
        rollouts = c.generate(roles, prompts, recipe, version, sampling=sampling, tag="e")
        scores = c.score(roles, rollouts)
    ray.get([a.drain_spans.remote() for a in roles.rollout])
    c.save_rollouts(run_dir, version, rollouts, scores, "eval")
    metrics = eval_metrics(rollouts, scores, e.k, e.pass_threshold)
    return {"eval/policy_version": version, **metrics, **episodes}, rollouts, scores
