"""What each algorithm asks of the run, stated once (pydantic-free dataclasses, no torch).

Every consumer reads these facts instead of comparing algorithm names: the loop and the
algorithm objects (does it sample, load a reference, a critic, a separate old-logprob
pass), preflight and the CLI (rollouts or preference pairs), and the planners (the
forward and backward passes one step makes, to count its FLOPs). Each algorithm's config
block (`config/algorithms.py`) builds its own facts from its settings; `Recipe.facts`
picks the block of `recipe.algorithm`.

A test counts the learner calls each algorithm object's step makes on a stand-in learner
and checks them against `passes` (tests/recipes/test_algorithm_facts.py), so the facts
and the code cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Passes:
    """The learner's passes over one step's whole batch, by model and kind.

    Attributes:
        policy_forward: no-grad forwards of the policy (`old_logprobs`).
        reference_forward: no-grad forwards of the frozen reference (`ref_logprobs`), per
            step; a precomputed reference counts 0 here (it runs once, before training).
        critic_forward: no-grad forwards of the critic (`values`).
        policy_train: forward + backward passes of the policy over the batch (epochs:
            each epoch's mini-batches together cover the batch once).
        critic_train: forward + backward passes of the critic over the batch.
    """

    policy_forward: int = 0
    reference_forward: int = 0
    critic_forward: int = 0
    policy_train: int = 1
    critic_train: int = 0


@dataclass(frozen=True)
class AlgorithmFacts:
    """What one algorithm needs of a run.

    Attributes:
        data: 'rollouts' (samples from rollout engines, scored by rewards, weights pushed
            back every step), 'pairs' (preference pairs: no engine, reward or push) or
            'chat' (conversations for supervised fine-tuning: no engine, reward or push).
        reference: the learner loads a frozen reference model.
        critic: the learner trains a value model beside the policy (PPO).
        updates_per_step: optimizer steps one training step takes (epochs × mini-batches).
        old_logprob_pass: `old_logprobs` get their own no-grad policy forward before the
            updates (otherwise the single update's own logprobs, detached, serve).
        passes: the forward/backward passes of one step (`Passes`).
        teacher: the frozen reference's own folder (on-policy distillation's teacher,
            `distill.teacher`): its tokenizer must equal the policy's; None: the
            reference is the policy's starting weights.
        reward_drives_advantage: the rewards are the learning signal (GRPO, PPO), so a
            group with no reward variance teaches nothing; False where another signal
            drives the update (distillation: the teacher's logprobs) and rewards are
            only measured.
        head: the policy's output head: 'lm' (a causal LM, token logprobs) or 'score'
            (a scalar per sequence: a reward model).
    """

    data: Literal["rollouts", "pairs", "chat"]
    reference: bool
    critic: bool
    updates_per_step: int
    old_logprob_pass: bool
    passes: Passes
    teacher: str | None = None
    reward_drives_advantage: bool = True
    head: Literal["lm", "score"] = "lm"

    @property
    def uses_rollouts(self) -> bool:
        """Starts rollout engines, a reward service and weight pushes."""
        return self.data == "rollouts"
