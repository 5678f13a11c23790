"""The recipe's `train:` block (steps, optimizer, checkpoints, restarts, asynchrony) and
its `reward_service:` block, the local reward service's deadlines and batching (pydantic,
no ML imports)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .algorithms import CorrectionConfig
from .asynchrony import stale_correction
from .base import Strict as _Strict


class RewardsServiceConfig(_Strict):
    """The local reward service that hosts the recipe's built-in components."""

    timeout_s: float = Field(
        60.0,
        gt=0,
        description="Deadline for each whole request, seconds: connect, send and the "
        "complete response, however slowly it arrives; then retried.",
    )
    retries: int = Field(2, ge=0, description="Retries of a failed request before items fail.")
    batch_size: int = Field(64, gt=0, description="Items per POST /score request.")
    workers: int = Field(
        2, gt=0, description="Items scored in parallel inside the service (code runs)."
    )


class TrainConfig(_Strict):
    steps: int = Field(gt=0, description="Optimizer steps (= policy versions) to run.")
    prompts_per_step: int = Field(gt=0, description="Prompts per step (groups per step).")
    micro_batch_size: int = Field(
        4, gt=0, description="Sequences per forward/backward on each learner worker."
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="Token budget per forward/backward: each learner worker sorts its rows "
        "by length and groups whole examples so a micro-batch holds at most this many real "
        "tokens (a longer example runs alone), cutting right padding; the loss is unchanged. "
        "null: fixed micro_batch_size rows. Reported as the padding_fraction metric.",
    )
    lr: float = Field(1e-6, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Linear LR warmup, in optimizer steps (train.steps × epochs × "
        "mini_batches for GRPO/PPO, train.steps for DPO and reward_model): optimizer step k, "
        "counted from 0, uses lr × min(1, (k + 1) / warmup_steps), so lr/warmup_steps at step "
        "0, 2·lr/warmup_steps at step 1, ..., and lr from step warmup_steps − 1 on (no step "
        "trains at 0). 0: lr from step 0. At most the run's optimizer steps.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global grad-norm clip.")
    seed: int = Field(0, description="Seed of sampling and initialisation.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass "
        "(transformers' gradient_checkpointing_enable, non-reentrant) instead of keeping "
        "them: about a third more compute for long sequences that would not fit otherwise.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer of the learner's policy and "
        "reference (inductor, per block, FSDP2's hooks eager). Full fine-tuning only. Pays a "
        "compile on the first micro-batch of each new shape; bench/compile.py measures "
        "whether it pays on your machine.",
    )
    save_final: bool = Field(True, description="Save the final policy with save_pretrained.")
    checkpoint_every: int | None = Field(
        None,
        gt=0,
        description="Write a training checkpoint (RUN_DIR/checkpoints/step_NNNNN: sharded "
        "policy, optimizer, critic, LR schedule, RNGs, data position) every N steps; null: "
        "only at the end of the run and on SIGTERM/Ctrl-C. `posttrain run --resume RUN_DIR` "
        "continues from the newest one.",
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Training checkpoints kept in RUN_DIR/checkpoints (oldest removed)."
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="Times a run may restart its learner group by itself after a learner rank "
        "dies (killed, out of memory): the whole group is started again from the newest "
        "checkpoint (from the initial weights at step 0 when none exists yet), the engines get "
        "that policy again and the steps after it run again. 0: the run stops, naming the "
        "checkpoint to resume from.",
    )
    max_empty_steps: int | None = Field(
        3,
        ge=1,
        description="Steps in a row with nothing to train on (every sample's scoring "
        "failed or was left out by on_reward_failure, or every response masked) after which "
        "the run stops with a checkpoint and exit 1 naming the cause, e.g. a reward service "
        "that is down. Such a step takes no optimizer step and reports empty_step: 1 "
        "(metrics, console). null: never stop.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="0: synchronous, on-policy steps (generate, score, train, push). k >= 1: "
        "rollouts for the next k steps are generated and scored while the learner trains "
        "(recipes/async_loop/); a sample made by policy_version v trains at step s only if "
        "s - v <= k, older ones are dropped (dropped_stale). GRPO and PPO, with "
        "grpo.dynamic_sampling, multi-turn episodes and agents, and train.max_restarts. "
        "A checkpoint holds the prompts generating or waiting, so after --resume each "
        "prompt trains once. With k >= 1 train.correction.mode defaults to tis (see there).",
    )
    max_token_staleness: int | None = Field(
        None,
        ge=0,
        description="With rollout.partial: the most policy versions any token of a "
        "trained sample may lag. null: train.max_staleness, and a sample's staleness counts "
        "from its oldest token. Larger: a group trains at step s when s minus its newest "
        "token's version (over its samples) is <= max_staleness and s minus its oldest "
        "token's version is <= this (a sample that ended early may then be older than "
        "max_staleness, never older than this); a long sample continued across pushes "
        "then trains instead of being dropped, each token weighted by train.correction "
        "against the policy that sampled it (its own inference_logprobs).",
    )
    staleness_policy: Literal["drop", "budget"] = Field(
        "drop",
        description="What the asynchronous loop does with a sample past the staleness "
        "bounds (train.max_staleness >= 1). drop: it is dropped and counted "
        "(dropped_stale), never trained. budget: no sample is dropped for staleness; the "
        "bound is on generation instead (AReaL's staleness budget): the producer keeps at "
        "most k x prompts_per_step groups (x rollout.oversample with partial rollouts) "
        "generating, scored or waiting, pauses while that buffer is full, and each step "
        "trains the oldest groups first, so a long sample continued across pushes trains "
        "when it finishes, weighed by train.correction (staleness_max shows how old). "
        "Needs a correction other than none; train.max_token_staleness stays null.",
    )
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)

    @model_validator(mode="before")
    @classmethod
    def _stale_samples_are_corrected(cls, data: Any) -> Any:
        return stale_correction(data)
