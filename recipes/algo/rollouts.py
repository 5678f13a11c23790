"""What every rollout algorithm's step (GRPO, PPO, distillation; synchronous or
asynchronous) does with its rollouts around the algorithm's `train`: the recipe's
`on_reward_failure` applied to the scores, rollouts + rewards → a padded `TrainBatch`,
and the rollout metrics every RL run reports. No algorithm's math lives here."""

from __future__ import annotations

import math
import statistics

import torch

from ...actors.rollout import Rollout
from ...algorithms.batch import TrainBatch, pack_rows
from ...rewards.protocol import Score, is_finite_number
from ..monitoring.signatures import sample_metrics


def rollout_batch(rollouts: list[Rollout], rewards: list[float | None], pad_id: int) -> TrainBatch:
    """Pad rollouts into `[B, T]` tensors (prompts left-padded to a common width, so
    responses start at one column), with the engines' `inference_logprobs`.

    A rollout whose reward is None (failed scoring) keeps its row but gets an all-zero
    response mask: it counts in no loss or statistic. A multi-turn episode's response
    mask is its `loss_mask` (0 on environment tokens), so those tokens count in no loss,
    token denominator or statistic either.

    Raises:
        ValueError: `rewards` and `rollouts` differ in length.
    """
    if len(rewards) != len(rollouts):
        raise ValueError(f"{len(rewards)} rewards for {len(rollouts)} rollouts")
    input_ids, attention, response, width_p = pack_rows(
        [(r.prompt_ids, r.response_ids) for r in rollouts], pad_id
    )
    inference = torch.zeros(input_ids.shape, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        inference[i, width_p : width_p + len(r.response_ids)] = torch.tensor(r.inference_logprobs)
        if r.loss_mask is not None:  # multi-turn: environment tokens are context only
            response[i, width_p : width_p + len(r.response_ids)] = torch.tensor(
                r.loss_mask, dtype=response.dtype
            )
        if rewards[i] is None:
            response[i] = 0.0
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response,
        response_start=width_p,
        inference_logprobs=inference,
    )


class RewardFailure(RuntimeError):
    """Scoring failed for some rollouts and the recipe says `on_reward_failure: fail_step`."""


def apply_failure_policy(
    scores: list[Score], rollouts: list[Rollout], policy: str
) -> list[float | None]:
    """Rewards to train on after the recipe's `on_reward_failure` (None = left out), one
    per rollout; `scores[i]` is `rollouts[i]`'s.

    drop_group: every rollout of a group with a failure becomes None. zero: failures
    score 0.0. fail_step: any failure raises. A reward that is not a finite number
    counts as a failure (the boundaries already turn those into failed scores; this is
    the last guard before the advantages).

    Raises:
        RewardFailure: `fail_step` and at least one failure (names the first few).
        ValueError: an unknown policy, or scores and rollouts of different lengths.
    """
    if len(scores) != len(rollouts):
        raise ValueError(f"{len(scores)} scores for {len(rollouts)} rollouts")
    rewards = [s.reward if is_finite_number(s.reward) else None for s in scores]
    failed = [i for i, x in enumerate(rewards) if x is None]
    if not failed:
        return rewards
    if policy == "fail_step":
        shown = "; ".join(f"{rollouts[i].group_id}: {scores[i].error}" for i in failed[:3])
        raise RewardFailure(
            f"{len(failed)} rollouts could not be scored ({shown}); "
            "set on_reward_failure: drop_group or zero to train on"
        )
    if policy == "zero":
        return [0.0 if x is None else x for x in rewards]
    if policy == "drop_group":
        bad = {rollouts[i].group_id for i in failed}
        return [None if r.group_id in bad else x for x, r in zip(rewards, rollouts, strict=True)]
    raise ValueError(f"unknown on_reward_failure {policy!r}")


def rollout_metrics(
    rollouts: list[Rollout],
    scores: list[Score],
    accuracy_component: str | None = None,
    many_answers: int = 4,
) -> dict[str, float]:
    """Reward mean/std, per-component means, response length, truncation and
    failed-score counts of one step; `accuracy` is the share of scored rollouts whose
    `accuracy_component` (a 0/1 verifier such as `math`) is 1; the verifier-bypass
    shares `hack/*` and `repetition` of recipes/monitoring/signatures.py (`many_answers`:
    `monitor.hacking.many_answers`)."""
    ok = [s.reward for s in scores if is_finite_number(s.reward)]
    lengths = [len(r.response_ids) for r in rollouts]
    out = {
        "reward_mean": statistics.fmean(ok) if ok else math.nan,
        "reward_std": statistics.pstdev(ok) if len(ok) > 1 else 0.0,
        "response_length_mean": statistics.fmean(lengths),
        "response_length_max": float(max(lengths)),
        "truncated_fraction": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
        "failed_scores": float(len(scores) - len(ok)),
    }
    comps: dict[str, list[float]] = {}
    for s in scores:
        for k, v in s.details.items():
            if "." not in k and isinstance(v, int | float) and math.isfinite(v):
                comps.setdefault(k, []).append(float(v))
    for k, vals in comps.items():
        out[f"reward/{k}"] = statistics.fmean(vals)
    if accuracy_component in comps:
        vals = comps[accuracy_component]
        out["accuracy"] = sum(v == 1.0 for v in vals) / len(vals)
    groups: dict[str, list[float]] = {}
    for r, s in zip(rollouts, scores, strict=True):
        if is_finite_number(s.reward):
            groups.setdefault(r.group_id, []).append(s.reward)
    out["groups_with_signal"] = float(sum(len(set(v)) > 1 for v in groups.values()))
    out["groups_scored"] = float(len(groups))
    scored = [
        (r.response_text, r.response_ids, s.details)
        for r, s in zip(rollouts, scores, strict=True)
        if is_finite_number(s.reward)
    ]
    return out | sample_metrics(scored, many_answers)
