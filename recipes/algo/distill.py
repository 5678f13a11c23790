"""On-policy distillation on the controller (`algorithm: distill`): the rollout step's
batch of student samples → the teacher's logprobs of them (the learner's reference pass;
the reference is loaded from `distill.teacher`) → per-token advantages teacher −
student (`algorithms.distill`), optionally mixed with the task reward → one update of
GRPO's policy-gradient loss. Sampling, scoring, pushes and telemetry are the rollout
step's (`recipes.loop.rl_step`), unchanged.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ...actors.rollout import Rollout
from ...algorithms.batch import TrainBatch, concat, pad_rows_to_multiple
from ...algorithms.distill import distill_advantages
from ...algorithms.grpo import GRPOLoss, group_advantages
from ...config import Recipe
from ..controller import on_learners
from .base import RLAlgorithm, correction_of, run_updates


class Distill(RLAlgorithm):
    """`algorithm: distill`: the student learns from the teacher's per-token judgement of
    its own samples (Agarwal et al. 2024, GKD; Thinking Machines 2025)."""

    name = "distill"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        d = recipe.distill
        self.loss = GRPOLoss(
            clip_low=d.clip_eps,
            clip_high=d.clip_eps,
            kl_coef=0.0,
            kind="ppo_clip",
            correction=correction_of(recipe),
            loss_agg="token_mean",
        )

    def train(
        self,
        learners: list[Any],
        batch: TrainBatch,
        rollouts: list[Rollout],
        rewards: list[float | None],
        step: int,
    ) -> dict[str, float]:
        """The teacher's pass, the advantages and one update; metrics
        `distill/reverse_kl` (mean student − teacher logprob per response token, the
        sampled reverse KL), `distill/teacher_logprob`, `distill/student_logprob` and
        `advantage_mean` over the step's response tokens."""
        d, t0 = self.recipe.distill, time.time()
        padded = pad_rows_to_multiple(batch, len(learners))
        teacher = concat(on_learners(learners, "compute", padded, step, "ref_logprobs"))
        teacher = teacher[: len(batch)]
        task = None
        if d.reward_weight > 0:
            reward_t = torch.tensor([math.nan if x is None else x for x in rewards])
            task = group_advantages(reward_t, [r.group_id for r in rollouts], True, 1e-6)
        m = batch.response_mask
        batch.advantages = distill_advantages(
            teacher,
            batch.inference_logprobs,
            m,
            kl_weight=d.kl_weight,
            discount=d.discount,
            clip=d.clip,
            task_advantages=task,
            reward_weight=d.reward_weight,
        )
        t_train = time.time()
        updates = run_updates(
            learners,
            batch,
            len(batch),
            1,
            1,
            self.loss.aggregation,
            self.recipe.train.seed * 7919 + step,
            step,
        )
        return {
            **updates,
            **distill_metrics(teacher, batch.inference_logprobs, batch.advantages, m),
            "time/logprobs": t_train - t0,
            "time/train": time.time() - t_train,
        }


def distill_metrics(
    teacher: torch.Tensor, student: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Means over the step's response tokens (`[B, T]` in; NaN for a step without one)."""
    n = float(mask.sum())
    if n == 0:
        return {"distill/reverse_kl": math.nan}
    return {
        "distill/reverse_kl": float(((student - teacher) * mask).sum()) / n,
        "distill/teacher_logprob": float((teacher * mask).sum()) / n,
        "distill/student_logprob": float((student * mask).sum()) / n,
        "advantage_mean": float((advantages * mask).sum()) / n,
    }
