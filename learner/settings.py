"""Plain settings of a learner rank, built by the controller from the recipe (the
learner never sees the `Recipe` itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..algorithms.grpo import GRPOLoss
from ..weightsync import TransportSettings
from .adapters import DEFAULT_TARGETS, AdapterSettings


def lr_factor(step: int, warmup_steps: int) -> float:
    """The share of the peak LR optimizer step `step` (counted from 0) uses: linear
    warmup min(1, (step + 1) / warmup_steps), so lr/warmup_steps at step 0 and lr from
    step warmup_steps − 1 on; 1 without warmup (`train.warmup_steps` says the same)."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


@dataclass(frozen=True)
class CriticSettings:
    """A value model next to the policy (PPO).

    Attributes:
        path: transformers folder to initialise it from; None: the policy's weights.
        lr: its AdamW learning rate.
    """

    path: str | None = None
    lr: float = 1e-5


@dataclass(frozen=True)
class SessionSettings:
    """Many LoRA sessions on one base (`posttrain serve`; learner/sessions.py).

    Attributes:
        max_rank: rank of the one adapter slot; a session's rank is at most this.
        target_modules: the linear layers the slot covers (a session trains all of them,
            or only the attention or MLP ones).
        max_sessions: how many sessions may be open at once on the learner.
        batch_sessions: how many sessions one forward may carry
            (`sessions_forward_backward`); the slot's LoRA rank is
            batch_sessions × max_rank.
    """

    max_rank: int = 32
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    max_sessions: int = 8
    batch_sessions: int = 1


@dataclass(frozen=True)
class LearnerSettings:
    """Plain values a learner rank needs.

    Attributes:
        model_path: the policy's transformers folder.
        compute_dtype: forward/backward dtype ('bfloat16' or 'float32'); master weights
            and AdamW stay float32. Weight pushes are cast to it (the engines' dtype).
        lr, betas, weight_decay, warmup_steps, max_grad_norm: AdamW and its schedule.
        micro_batch_size: rows per forward/backward (rounded up to whole examples, e.g.
            pairs for DPO).
        max_tokens_per_micro_batch: a token budget per micro-batch instead of
            `micro_batch_size` rows (see learner/micro_batches.py), or None.
        temperature: logits are divided by it (the rollout's sampling temperature).
        seed: torch seed at setup.
        algorithm: 'grpo', 'ppo', 'dpo' or 'reward_model': picks the loss
            (`algorithms.loss_module`).
        loss: that loss's settings (`GRPOLoss`, `PPOLoss`, `DPOLoss`, `RewardModelLoss`).
        head: 'lm': the policy is a causal LM (logprobs); 'score': the architecture with
            a scalar head (`AutoModelForSequenceClassification`, one label), a reward
            model, saved in that format.
        load_reference: keep a frozen reference (KL, DPO); with an adapter the reference
            is the policy with its adapter disabled, never a copy.
        reference_path: the reference's own transformers folder (on-policy
            distillation's teacher), loaded as a frozen copy even with an adapter; None:
            the policy's starting weights (`model_path`).
        critic: a value model (PPO), or None.
        transport: how weight pushes travel (and whether they are checksummed or
            adapter-only).
        adapter: LoRA / QLoRA settings.
        delay_s: test knob, extra busy seconds per train_step.
        device: 'cpu' or 'cuda' (`resources.device`): where this rank computes.
        gradient_checkpointing: recompute activations in backward (`train.`).
        compile: `torch.compile` the policy's and reference's decoder layers
            (`train.compile`).
        sessions: host LoRA sessions (learner/sessions.py) instead of training one
            policy: `adapter`, `algorithm`, `loss`, the reference, the critic and the
            recipe's optimizer are then unused; None: a recipe's learner.
    """

    model_path: str
    compute_dtype: str = "bfloat16"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4
    max_tokens_per_micro_batch: int | None = None
    temperature: float = 1.0
    seed: int = 0
    algorithm: str = "grpo"
    loss: Any = GRPOLoss()
    head: Literal["lm", "score"] = "lm"
    load_reference: bool = False
    reference_path: str | None = None
    critic: CriticSettings | None = None
    transport: TransportSettings = TransportSettings()
    adapter: AdapterSettings = field(default_factory=AdapterSettings)
    delay_s: float = 0.0
    device: str = "cpu"
    gradient_checkpointing: bool = False
    compile: bool = False
    sessions: SessionSettings | None = None
