"""The recipe schema: one YAML file says what to train, on what, with which rewards,
on how many devices, and where the run goes.

This module holds the whole `Recipe` and its rules that span blocks; each block is a
module of its own (`model`, `rollout`, `train`, `weight_sync`, `data`, `rewards`, ...).
It imports pydantic and nothing from the ML stack, so a recipe validates
anywhere (CLI, CI, a reward host) in well under a second. Every field is documented
beside itself; bounds are `Field` constraints; rules that span fields are model
validators whose messages name the key path and say what to set instead.

Which way it travels: user's YAML → `posttrain.recipes.loading.load_recipe` →
controller (and, as plain values, to each role's constructor). Loading and overrides
live in `recipes/loading.py`, checks that need the file system in
`recipes/preflight.py`; this package holds only the models.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from .algorithms import (
    DPOConfig,
    GRPOConfig,
    PPOConfig,
    RewardModelConfig,
)
from .asynchrony import check_async_and_correction
from .base import Strict
from .data import MAX_SAMPLES, DataConfig, FileData, GeneratorData, sources_of
from .distill import DistillConfig, check_distill
from .env_data import check_vf1_sources
from .episodes import check_episodes
from .evaluation import EvalConfig
from .facts import AlgorithmFacts
from .model import ModelConfig
from .monitor import (  # noqa: F401  (re-exported: recipe.MonitorConfig)
    AdvisoriesConfig,
    DebugConfig,
    MonitorConfig,
    check_hacking,
)
from .resources import (  # noqa: F401  (re-exported: recipe.ResourcesConfig)
    LearnerResources,
    ResourcesConfig,
    RolloutResources,
)
from .rewards import RewardSpec
from .rollout import RolloutConfig, VLLMConfig, vllm_installed  # noqa: F401  (re-exported)
from .sft import SFTConfig, check_prompt_data, check_sft_data
from .train import RewardsServiceConfig, TrainConfig
from .weight_sync import WeightSyncConfig

_Strict = Strict  # every recipe block forbids unknown keys


class Recipe(_Strict):
    """A whole training recipe; see recipes/quickstart_grpo.yaml for a commented example."""

    name: str = Field(
        description="Run name (letters, digits, '.', '_', '-'); the default run folder is "
        "runs/<name>-<time>."
    )
    algorithm: Literal["grpo", "ppo", "dpo", "reward_model", "sft", "distill"] = Field(
        description="Training algorithm: grpo, ppo, dpo, reward_model (a Bradley-Terry "
        "reward model on preference pairs), sft (supervised fine-tuning on chat rows), or "
        "distill (on-policy distillation from distill.teacher)."
    )
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="Reward components (GRPO, at least one); an item's reward is their "
        "weighted sum.",
    )
    reward_service: RewardsServiceConfig = Field(default_factory=RewardsServiceConfig)
    on_reward_failure: Literal["drop_group", "zero", "fail_step"] = Field(
        "drop_group",
        description="When an item cannot be scored (after retries): drop_group leaves its whole "
        "group out of the step; zero scores it 0 (counted in failed_scores); fail_step stops "
        "the run (rollouts already saved).",
    )
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    train: TrainConfig
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    eval: EvalConfig | None = Field(
        None, description="Evaluation on held-out prompts during training (GRPO, PPO)."
    )
    debug: DebugConfig = Field(default_factory=DebugConfig)

    @property
    def facts(self) -> AlgorithmFacts:
        """What `algorithm` asks of the run (config/facts.py), from its own block."""
        block: (
            GRPOConfig | PPOConfig | DPOConfig | RewardModelConfig | SFTConfig | DistillConfig
        ) = getattr(self, self.algorithm)
        return block.facts()

    @property
    def pair_margin_key(self) -> str | None:
        """The preference rows' per-pair margin key: the reward model's `margin_key`
        (DPO reads no margin)."""
        return self.reward_model.margin_key if self.algorithm == "reward_model" else None

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, v: str) -> str:
        # it becomes a folder under runs/: no '/', '..', spaces or empty names
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", v):
            raise ValueError(
                f"{v!r} cannot name a run folder (runs/<name>-<time>); use letters, digits, "
                "'.', '_' and '-' (starting with a letter or digit), e.g. my-run"
            )
        return v

    @model_validator(mode="after")
    def _no_other_algorithms_block(self) -> Recipe:
        # Each algorithm reads only its own block (named as the algorithm); a key of another
        # block that differs from its default would be ignored without a word. Defaults
        # given explicitly (the quickstart's `grpo:` under `--set algorithm=ppo`) change
        # nothing, so they pass.
        for block in get_args(Recipe.model_fields["algorithm"].annotation):
            if block == self.algorithm:
                continue
            cfg = getattr(self, block)
            fields = type(cfg).model_fields
            changed = sorted(
                k
                for k in cfg.model_fields_set
                if getattr(cfg, k) != fields[k].get_default(call_default_factory=True)
            )
            if changed:
                raise ValueError(
                    f"{block}.{changed[0]} is set, but algorithm is {self.algorithm} and "
                    f"only {block} reads the {block} block; set algorithm: {block}, or "
                    f"remove {block}.{changed[0]}"
                )
        return self

    @model_validator(mode="after")
    def _algorithm_fits_data(self) -> Recipe:
        if self.facts.data == "chat":
            check_sft_data(self)
            return self
        check_prompt_data(self)
        pairs = self.facts.data == "pairs"
        name = "DPO" if self.algorithm == "dpo" else "A reward model"
        if pairs and self.eval is not None:
            raise ValueError(
                f"eval: {name} samples no responses to evaluate; remove the eval "
                "block, or use algorithm grpo or ppo"
            )
        if not pairs and self.data.heldout is not None:
            raise ValueError(
                f"data.heldout: held-out preference pairs are for DPO and reward models; "
                f"{self.algorithm} holds out prompts with eval: {{prompts: ...}} or "
                "eval: {holdout: N}"
            )
        if self.data.heldout is not None and self.reward_model.eval_pairs:
            raise ValueError(
                "reward_model.eval_pairs and data.heldout both hold pairs out; keep one "
                "(data.heldout: a file of its own, disjoint from data.train)"
            )
        generated = [
            s.generator if isinstance(s, GeneratorData) else getattr(s, "reasoning_gym", "env")
            for s in sources_of(self.data.train)
            + (sources_of(self.data.heldout) if self.data.heldout else [])
            if not isinstance(s, FileData)
        ]
        if pairs and generated:
            raise ValueError(
                f"data.train: {name} trains on preference pairs, and {generated[0]!r} "
                "makes prompts only; give a file of pairs {path: pairs.jsonl} (chosen / "
                "rejected, with or without a shared prompt; format: hh for HH-RLHF)"
            )
        if self.algorithm == "reward_model" and self.rewards:
            raise ValueError(
                "rewards: a reward model trains on preference pairs and calls no "
                "reward; remove the rewards list"
            )
        if not pairs and not self.rewards:
            raise ValueError(
                f"rewards: {self.algorithm.upper()} needs at least one reward "
                "component, e.g. [{name: correct, type: math}]"
            )
        return self

    @model_validator(mode="after")
    def _cross_field(self) -> Recipe:
        self._samples_fit()
        if self.algorithm == "grpo" and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "rollout.samples_per_prompt is "
                f"{self.rollout.samples_per_prompt}, but GRPO normalises rewards within a group "
                "of samples of the same prompt, so one sample always gets advantage 0; "
                "set rollout.samples_per_prompt: 2 or more"
            )
        if self.algorithm in ("grpo", "ppo"):
            rows = self.train.prompts_per_step * self.rollout.samples_per_prompt
            split = getattr(self, self.algorithm).mini_batches
            if split > rows:
                raise ValueError(
                    f"{self.algorithm}.mini_batches is {split}, but a step has only {rows} "
                    "rollouts (train.prompts_per_step × rollout.samples_per_prompt), so some "
                    f"mini-batches would hold none; set {self.algorithm}.mini_batches: {rows} "
                    "or less"
                )
        self._grpo_family_keys()
        self._warmup_fits()
        check_episodes(
            self.algorithm, self.rollout, self.grpo.dynamic_sampling, self.grpo.overlong_buffer
        )
        eval_prompts = self.eval.prompts if self.eval is not None else None
        check_vf1_sources(self.rollout.environment, self.data.train, eval_prompts)
        check_async_and_correction(self)
        names = [r.name for r in self.rewards]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rewards: names {dup} repeat; give each reward a unique name")
        return self

    def _samples_fit(self) -> None:
        """A step's rollouts are at most `MAX_SAMPLES` (eval's own block checks its)."""
        rows = self.train.prompts_per_step * self.rollout.samples_per_prompt
        if self.algorithm in ("grpo", "ppo", "distill") and rows > MAX_SAMPLES:
            raise ValueError(
                f"train.prompts_per_step × rollout.samples_per_prompt is {rows:,} rollouts "
                f"a step, more than the {MAX_SAMPLES:,} a step may hold (every one is queued "
                "on the engines at once and kept until the update); lower one of the two"
            )

    def _warmup_fits(self) -> None:
        """`train.warmup_steps` ends within the run, or the LR never reaches `train.lr`."""
        t = self.train
        per_step = self.facts.updates_per_step
        total = t.steps * per_step
        if t.warmup_steps > total:
            how = f" ({t.steps} steps × {per_step} updates each)" if per_step > 1 else ""
            raise ValueError(
                f"train.warmup_steps is {t.warmup_steps}, but the run takes {total} optimizer "
                f"steps{how}, so the learning rate would peak at {total}/{t.warmup_steps} of "
                f"train.lr; set train.warmup_steps: {total} or less (or raise train.steps)"
            )

    def _grpo_family_keys(self) -> None:
        """GSPO sums no tokens, and the overlong buffer must end before the length limit
        (another algorithm's `grpo:` keys: `_no_other_algorithms_block`)."""
        g = self.grpo
        if g.loss == "gspo" and g.loss_agg != "token_mean":
            raise ValueError(
                f"grpo.loss_agg is {g.loss_agg!r}, but grpo.loss gspo averages over "
                "sequences by its objective (each sequence's clipped term once, whatever its "
                "length), so it sums no tokens; remove grpo.loss_agg (or use grpo.loss "
                "ppo_clip for Dr. GRPO's token sums)"
            )
        limit = self.rollout.max_new_tokens
        if g.overlong_buffer is not None and g.overlong_buffer >= limit:
            raise ValueError(
                f"grpo.overlong_buffer is {g.overlong_buffer}, but rollout.max_new_tokens is "
                f"{limit}: the penalty buffer must be the last tokens before the limit; set "
                f"grpo.overlong_buffer below {limit} (DAPO uses a quarter of it)"
            )

    @model_validator(mode="after")
    def _distill_keys(self) -> Recipe:
        check_distill(self.algorithm, self.distill, self.rollout.samples_per_prompt)
        return self

    @model_validator(mode="after")
    def _hacking_keys(self) -> Recipe:
        names = [r.name for r in self.rewards]
        check_hacking(self.monitor.hacking, names, self.eval is not None)
        return self

    @model_validator(mode="after")
    def _devices(self) -> Recipe:
        res = self.resources
        if self.weight_sync.type == "cuda_ipc" and not (res.device == "cuda" and res.colocate):
            raise ValueError(
                "weight_sync.type: cuda_ipc hands tensors between processes on one GPU, so it "
                "needs resources.device: cuda and resources.colocate: true; set both, or "
                "weight_sync.type: collective"
            )
        merged_adapter = (
            self.model.adapter.type != "none" and self.weight_sync.adapter_mode == "merged"
        )
        if self.weight_sync.type == "cuda_ipc" and merged_adapter and res.rollout.gpus > 1:
            # Only learner rank 0 builds the merged tensors, so only its GPU's engine
            # would receive them.
            raise ValueError(
                "weight_sync.type: cuda_ipc with model.adapter and weight_sync.adapter_mode: "
                "merged reaches only the engine on learner rank 0's GPU; with "
                f"resources.rollout.gpus {res.rollout.gpus} set weight_sync.type: "
                "object_store, or resources.rollout.gpus: 1"
            )
        if res.rollout.gpus_per_engine != 1 and self.rollout.engine != "vllm":
            raise ValueError(
                "resources.rollout.gpus_per_engine > 1 is tensor parallelism, which only "
                "rollout.engine: vllm runs; set rollout.engine: vllm, or gpus_per_engine: 1"
            )
        if res.colocate and res.device == "cuda" and self.weight_sync.type == "collective":
            raise ValueError(
                "weight_sync.type: collective would make an NCCL group of learner rank 0 and "
                "the engine on the same GPU, which NCCL refuses (one rank per GPU); colocated "
                "on cuda set weight_sync.type: cuda_ipc (or object_store)"
            )
        if self.rollout.vllm.async_engine and self.rollout.engine != "vllm":
            raise ValueError(
                f"rollout.vllm.async_engine is true, but rollout.engine is "
                f"{self.rollout.engine!r}; set rollout.engine: vllm, or remove "
                "rollout.vllm.async_engine"
            )
        if self.rollout.engine == "vllm" and self.rollout.vllm.async_engine:
            uses = [
                what
                for what, on in (
                    (
                        "weight_sync.adapter_mode: adapter (a vLLM LoRA)",
                        self.model.adapter.type != "none"
                        and self.weight_sync.adapter_mode == "adapter",
                    ),
                    ("resources.rollout.gpus_per_engine > 1", res.rollout.gpus_per_engine != 1),
                    (
                        "resources.colocate on cuda (sleep mode)",
                        res.colocate and res.device == "cuda",
                    ),
                )
                if on
            ]
            if uses:
                raise ValueError(
                    f"rollout.vllm.async_engine does not serve {', '.join(uses)}; set "
                    "rollout.vllm.async_engine: false (the synchronous engine serves them)"
                )
        if res.rollout.gpus_per_engine != 1 and self.weight_sync.type == "collective":
            raise ValueError(
                "weight_sync.type: collective broadcasts into the engine actor's own GPU, and a "
                "tensor-parallel engine's GPUs belong to its vLLM workers (receiving in each "
                "worker is not built yet); set weight_sync.type: object_store (or "
                "filesystem) with rollout.gpus_per_engine > 1"
            )
        return self

    @model_validator(mode="after")
    def _adapter_sync(self) -> Recipe:
        if self.weight_sync.adapter_mode == "adapter" and self.model.adapter.type == "none":
            raise ValueError(
                "weight_sync.adapter_mode: 'adapter' sends only adapter tensors, "
                "but model.adapter.type is 'none'; set model.adapter.type: lora "
                "(or qlora), or adapter_mode: merged"
            )
        if self.weight_sync.adapter_mode == "adapter" and self.model.adapter.use_dora:
            raise ValueError(
                "weight_sync.adapter_mode: 'adapter' loads the adapter as a vLLM "
                "LoRA, and vLLM does not serve DoRA; set adapter_mode: merged"
            )
        if self.train.compile and self.model.adapter.type != "none":
            # peft's wrapped layers and torchao's NF4 tensors are untested under dynamo here
            raise ValueError(
                f"train.compile is on with model.adapter.type "
                f"'{self.model.adapter.type}'; compiling is built for full "
                "fine-tuning only: set train.compile: false or "
                "model.adapter.type: none"
            )
        return self


def default_facts(algorithm: object) -> AlgorithmFacts | None:
    """What `algorithm` asks of a run under its block's defaults, for a recipe not yet
    validated (`posttrain assess` choosing its overrides from the raw YAML); None for
    anything that names no algorithm (validation then says so). Of the facts, `data` and
    `head` never depend on a block's settings."""
    if algorithm not in get_args(Recipe.model_fields["algorithm"].annotation):
        return None
    block = Recipe.model_fields[str(algorithm)].default_factory
    return block().facts() if block is not None else None
