"""One algorithm object per recipe on the controller: what the learner needs, how a
step's batch is made and how a step trains. The loop, the CLI and `start_learners`
look it up once (`algorithm_for`) and never branch on the algorithm's name.

- RL algorithms (`RLAlgorithm`: GRPO in recipes/algo/grpo.py, PPO in recipes/algo/ppo.py,
  on-policy distillation in recipes/algo/distill.py) share one step,
  `recipes.loop.rl_step`: generate → score → batch → `train` → push.
- DPO (recipes/algo/dpo.py) and the reward model (recipes/algo/reward_model.py) have no rollout
  side: their `step` trains on preference pairs; SFT (recipes/algo/sft.py) likewise on
  conversations.
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from typing import Any

import torch

from ...actors.rollout import Rollout
from ...algorithms.batch import TrainBatch, pad_rows_to_multiple
from ...algorithms.common import loss_denominator
from ...algorithms.correction import Correction
from ...common.model_registry import resolve_model_path
from ...common.telemetry import Span
from ...config import Recipe
from ..controller import on_learners
from ..state import Run


class Algorithm(ABC):
    """What every algorithm tells the run.

    Attributes:
        name: the recipe's `algorithm`.
        facts: what the algorithm asks of the run (`config.facts.AlgorithmFacts`, read
            from the recipe's algorithm block: rollouts or pairs, reference, critic,
            passes per step).
        uses_rollouts: starts rollout engines, a reward service and weight pushes.
        loss: the learner's loss settings (`algorithms.<name>.<Name>Loss`).
        load_reference: the learner keeps a frozen reference.
        reference_path: the reference's own folder (distillation's teacher, resolved),
            or None: the policy's starting weights.
        critic: the learner's `CriticSettings`, or None.
        temperature: logits are divided by it on the learner.
        head: the learner's policy head (`facts.head`): 'lm' (a causal LM) or 'score'
            (a scalar-head reward model).
    """

    name: str
    critic: Any = None

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.facts = recipe.facts
        self.load_reference = self.facts.reference
        self.head = self.facts.head
        self.temperature = recipe.rollout.temperature

    @property
    def uses_rollouts(self) -> bool:
        return self.facts.uses_rollouts

    @property
    def reference_path(self) -> str | None:
        """The reference's own folder (`facts.teacher`, an alias converted on first use),
        read when the learners start; None: the policy's starting weights."""
        teacher = self.facts.teacher
        return str(resolve_model_path(teacher)) if teacher else None

    def prepare(self, run: Run) -> None:
        """Work before the first step, once the roles run (DPO: reference precompute)."""
        return None

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint records of the algorithm beyond the learners' state
        (JSON-able); GRPO and PPO keep nothing on the controller between steps."""
        return {}


class RLAlgorithm(Algorithm):
    """GRPO and PPO: the loop's rollout step (`recipes.loop.rl_step`, or
    `recipes.async_loop.async_step` with `train.max_staleness` ≥ 1) samples, scores and
    batches; each algorithm says how it trains on that batch."""

    @abstractmethod
    def train(
        self,
        learners: list[Any],
        batch: TrainBatch,
        rollouts: list[Rollout],
        rewards: list[float | None],
        step: int,
    ) -> dict[str, float]:
        """Advantages and the optimizer step(s) of one step on the learner group.

        Args:
            batch: `rollout_batch` of the step (rows of unscored rollouts masked out).
            rewards: the rewards to train on, after `on_reward_failure` (None: left out).
        """


class PairAlgorithm(Algorithm):
    """DPO, the reward model and SFT: no rollout side; the loop's pair step is the
    algorithm's own `step`, which trains on the step's preference pairs (SFT: its
    conversations)."""

    @abstractmethod
    def step(self, run: Run, step: int) -> tuple[dict[str, float], list[Span]]:
        """One training step of `run` (recipes/state.py); returns its metrics and
        every worker's busy spans of the step."""


def run_updates(
    learners: list[Any],
    batch: TrainBatch,
    rows: int,
    epochs: int,
    mini_batches: int,
    loss_agg: str,
    seed: int,
    step: int,
) -> dict[str, float]:
    """`epochs × mini_batches` optimizer steps on the first `rows` rows of `batch` (the
    rest only pads the no-grad passes). Each epoch splits the real rows into
    `mini_batches` (shuffled, seeded, when there is more than one update), and each
    mini-batch is padded to a multiple of the ranks on its own, so none is all padding;
    its loss is normalised over that mini-batch (`loss_denominator`). A mini-batch
    without a response token (every row masked) is skipped: no optimizer step without
    data (AdamW would move the weights on momentum and decay alone). Returns each
    metric's mean over the updates, with `grad_norm` and `lr` of the last one,
    `updates`, the optimizer steps asked of the learner (only `updates` 0 when every
    mini-batch was empty), and `skipped_updates` summed (updates the learner did not
    apply: a non-finite loss or gradient)."""
    g = torch.Generator().manual_seed(seed)
    shuffle = epochs * mini_batches > 1
    real = batch.select(slice(0, rows))
    updates = []
    for _ in range(epochs):
        order = torch.randperm(rows, generator=g) if shuffle else torch.arange(rows)
        for idx in order.chunk(mini_batches):
            sub = pad_rows_to_multiple(real.select(idx), len(learners))
            if float(sub.response_mask.sum()) == 0.0:
                continue
            sub.loss_denominator = loss_denominator(sub.response_mask, loss_agg)
            updates.append(on_learners(learners, "train_step", sub, step)[0])
    if not updates:
        return {"updates": 0.0}
    stats = {k: statistics.fmean(u[k] for u in updates) for k in updates[0]}
    if "skipped_updates" in stats:
        stats["skipped_updates"] = sum(u["skipped_updates"] for u in updates)
    last = {"grad_norm": updates[-1]["grad_norm"], "lr": updates[-1]["lr"]}
    return {**stats, **last, "updates": float(len(updates))}


def correction_of(recipe: Recipe) -> Correction:
    """The learner's plain settings of `train.correction`."""
    c = recipe.train.correction
    return Correction(mode=c.mode, level=c.level, cap=c.cap)
