"""The recipe's `rollout:` block: how samples are drawn (engine, sampling parameters,
partial rollouts and over-sampling) and its `rollout.vllm:` settings (pydantic, no ML
imports; whether vLLM is installed is looked up without importing it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Strict as _Strict
from .episodes import EpisodeFields


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
        "time: a long sample holds its own slot, not a round (see rollout.oversample). A "
        "checkpoint keeps each untrained prompt's samples so far and --resume continues "
        "them from their tokens ('hf', synchronous 'vllm'; with async_engine they are "
        "generated again, and the resume says so).",
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
