"""The interface every inference engine behind a `RolloutWorker` implements.

An engine owns one model replica. It samples, loads new weights in place, and can
checksum what it holds. Engines are used by one thread at a time (the worker's).

Sampling uses the recipe's parameters only: a model's `generation_config.json` may set
its own (Qwen2.5-Instruct ships `repetition_penalty: 1.05`, top_k, top_p), and an
engine that applied them would sample from a distribution other than the
`log_softmax(logits / T)` its `inference_logprobs` describe. Its end-of-sequence ids
are the one thing taken from the model folder, through `stop_token_ids`, the same set
on every engine.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .rollout import FinishReason, SamplingSettings


@dataclass(frozen=True)
class Sample:
    """One engine output: `[R]` token ids and their logprobs under temperature.

    `interrupted`: `generate_interruptible` stopped it early (a weight push arrived)
    before its end; `finish_reason` then reads 'length' and the sample is to be
    continued (actors/partial.py).
    `versions`: `[R]` the policy_version that sampled each token, from engines that
    load weights while requests are in flight (`InferenceEngine.concurrent`); None from
    the others (every token then has the version the worker holds)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    interrupted: bool = False
    versions: list[int] | None = None


@dataclass(frozen=True)
class EngineSettings:
    """Plain values that build one engine (from the recipe's `rollout` and `model`).

    Attributes:
        kind: 'vllm' (vLLM's synchronous `LLM`), 'vllm_async' (vLLM's `AsyncLLM`:
            `rollout.engine: vllm` with `rollout.vllm.async_engine`) or 'hf'.
        model_path: transformers folder.
        dtype: 'bfloat16' or 'float32'.
        seed: engine seed.
        kv_cache_gb: vLLM KV cache, GiB.
        max_model_len: vLLM's longest prompt + response, tokens (None: the model's).
        enforce_eager: vLLM without torch.compile / CUDA graphs.
        device: 'cpu' or 'cuda'.
        lora_rank: with adapter-only weight sync, the adapter's rank (the engine serves
            base + the newest LoRA adapter); None otherwise.
        gpu_memory_utilization: vLLM on cuda: share of the GPU it may take (None: a KV
            cache of `kv_cache_gb`).
        tensor_parallel_size: vLLM on cuda: GPUs per engine (`gpus_per_engine`).
        sleep_between_steps: vLLM on cuda, colocated: release the KV cache and offload
            the weights after each generate (`LLM.sleep(level=1)`), so the learner rank
            on the same GPU has its memory while it trains; woken before the next load
            or generate.
        direct_load: vLLM on CPU: load pushes straight into the layers' kernels
            (`rollout.vllm.direct_load`, actors/vllm_direct.py).
        max_adapters: named LoRA adapters (the service's sessions) held at once, the
            least recently used evicted beyond (vLLM: `max_loras` and `max_cpu_loras`;
            actors/adapter_slots.py). vLLM serves ranks up to `lora_rank`.
    """

    kind: Literal["vllm", "vllm_async", "hf"]
    model_path: str
    dtype: str = "bfloat16"
    seed: int = 0
    kv_cache_gb: float = 1.0
    max_model_len: int | None = None
    enforce_eager: bool = True
    device: str = "cpu"
    lora_rank: int | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    sleep_between_steps: bool = False
    direct_load: bool = True
    max_adapters: int = 1


# An odd 64-bit constant (2^64 / golden ratio): rank r's seed is `seed + r * stride`, so
# the seeds of neighbouring ranks and of the steps a rank samples in (seed + step) stay
# far apart.
_SEED_STRIDE = 0x9E3779B97F4A7C15


def engine_seed(seed: int, rank: int) -> int:
    """The seed rollout engine `rank` uses where its run gives every engine `seed` (the
    recipe's `train.seed` for the engine itself; a step's sampling seed, which already
    holds the recipe's seed, the step and the round): `(seed + rank × 0x9E3779B97F4A7C15)
    mod 2^32`, since vLLM seeds numpy with it, which takes 0 ≤ seed < 2^32 (a larger one
    killed every engine but rank 0 at start-up). Rank 0 keeps any `seed` below 2^32, so a
    run with one engine samples as it did before engines had seeds of their own.

    Engines given the same seed return the same samples for the same prompt, so without
    this two engines sampling one prompt (a group split over engines, an evaluation,
    agent episodes) would repeat each other. Pure, so a resumed or replaced engine of
    the same rank repeats its samples.
    """
    return (seed + rank * _SEED_STRIDE) % 2**32


# Content of an assistant turn rendered to find the token that ends the turn.
_TURN_PROBE = "posttrain-end-of-turn-probe"


def end_of_turn_token_id(tokenizer: Any) -> int | None:
    """The special token the chat template puts right after an assistant turn's content
    (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), or None when the template has none
    there (no template, plain text after the turn, or a template that cannot render a
    user + assistant exchange)."""
    from jinja2 import TemplateError

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except (TemplateError, ValueError, TypeError, KeyError):
        return None
    if not isinstance(text, str) or _TURN_PROBE not in text:
        return None
    tail = text.rsplit(_TURN_PROBE, 1)[1].lstrip()
    ids = tokenizer.encode(tail, add_special_tokens=False) if tail else []
    if not ids:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = ids[0] in set(tokenizer.all_special_ids) or getattr(
        added.get(ids[0]), "special", False
    )
    return ids[0] if special else None


def _config_eos_ids(model_path: str) -> list[int]:
    """`eos_token_id` (an int or a list) of the folder's generation_config.json, else of
    its config.json (transformers derives the generation config from it then)."""
    for name in ("generation_config.json", "config.json"):
        file = Path(model_path) / name
        if not file.is_file():
            continue
        eos = json.loads(file.read_text()).get("eos_token_id")
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def stop_token_ids(tokenizer: Any, model_path: str) -> list[int]:
    """Token ids that end a sample: the union of the tokenizer's `eos_token_id`, the
    model folder's generation-config EOS ids and the chat template's end-of-turn token.

    Models disagree among these (a tokenizer whose eos is `<|im_end|>` beside a
    generation_config.json naming `<|endoftext|>`); stopping on only one lets samples run
    past the end of the assistant's turn. Every engine stops on this same set.

    Args:
        tokenizer: the engine's transformers tokenizer (with its chat template).
        model_path: the transformers folder the engine loaded.

    Returns:
        The ids, sorted, without repeats; never empty.

    Raises:
        ValueError: none of the three sources names an end-of-sequence token.
    """
    ids = set(_config_eos_ids(model_path))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if (turn := end_of_turn_token_id(tokenizer)) is not None:
        ids.add(turn)
    if not ids:
        raise ValueError(
            f"{model_path}: neither the tokenizer, generation_config.json nor the "
            "chat template names an end-of-sequence token; set eos_token in "
            "tokenizer_config.json"
        )
    return sorted(ids)


def check_sampling(sampling: SamplingSettings) -> None:
    """Refuse settings no engine can honour.

    Raises:
        ValueError: an empty stop string (every text contains it, so every sample
            would end after its first token), or a negative stop token id.
    """
    if bad := [t for t in sampling.stop_token_ids if t < 0]:
        raise ValueError(f"stop token ids must be token ids (≥ 0); got {bad[:3]}")
    if any(s == "" for s in sampling.stop):
        raise ValueError(
            "stop strings must not be empty: every text contains '', so every "
            "sample would end after one token; remove it from rollout.stop"
        )


def check_prompt_lengths(prompts: list[list[int]], context_tokens: int | None) -> None:
    """Refuse, before any engine sees them, prompts that leave no room for one token.

    Args:
        prompts: `[N][P_i]` prompt token ids.
        context_tokens: the engine's `context_tokens` (None: no check).

    Raises:
        ValueError: names the first prompt over the limit, its length and the limit.
    """
    if context_tokens is None:
        return
    for i, p in enumerate(prompts):
        if len(p) >= context_tokens:
            raise ValueError(
                f"prompt {i} is {len(p)} tokens; the engine takes {context_tokens} tokens "
                "(prompt + completion), so it was not sampled; shorten it"
            )


class InferenceEngine(ABC):
    """Sampling engine of one rollout worker."""

    #: a transformers tokenizer with the model's chat template; set by each engine.
    tokenizer: Any
    #: the most tokens (prompt + completion) one sequence may hold; None: unknown.
    context_tokens: int | None = None
    #: True: `generate` may be called from several threads at once (their requests are
    #: batched together) and `load_weights` may run while they are in flight: it pauses
    #: them, keeping every request, and each `Sample.versions` says which policy_version
    #: sampled each token. False: one thread at a time (the worker's engine lock).
    concurrent: bool = False

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` under the chat template, with the generation prompt."""
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids` without special tokens."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Sample]]:
        """`sampling.n` samples per prompt; result[i] holds prompt i's samples in order."""

    def generate_interruptible(
        self, prompts: list[list[int]], sampling: SamplingSettings, interrupt: threading.Event
    ) -> list[list[Sample]]:
        """As `generate`, but may return once `interrupt` is set, every sample not yet
        ended then marked `interrupted` (partial rollouts, actors/partial.py). Each
        sample holds at least the tokens sampled before the interrupt was seen.

        Default: `generate`, run to the end (an engine that cannot stop mid-batch; a
        push then waits for the batch)."""
        return self.generate(prompts, sampling)

    @abstractmethod
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> list[str]:
        """Copy `(name, tensor)` pairs into the model in place; returns the names loaded.
        `version`: the policy_version of these weights, which a `concurrent` engine tags
        the tokens it samples from now on with (others ignore it).

        Raises:
            ValueError: an unknown name, a shape mismatch, or a model parameter left
                without a new value (the engine must never keep stale weights silently).
        """

    def validate_names(self, names: Iterable[str]) -> None:
        """Refuse, before anything is loaded, a push whose names are unknown or leave a
        parameter without a new value. Default: no check (`load_weights` checks after).

        Raises:
            ValueError: names the unknown or missing weights.
        """
        return None

    def load_adapter(
        self, weights: Iterable[tuple[str, torch.Tensor]], config: dict, version: int
    ) -> list[str]:
        """Serve base + this LoRA adapter from now on (adapter-only weight sync).

        Args:
            weights: PEFT-format adapter tensors (`...q_proj.lora_A.weight` `[r, in]`,
                `...lora_B.weight` `[out, r]`), as `get_peft_model_state_dict` names them.
            config: the adapter's `peft.LoraConfig` as a plain dict.
            version: the policy_version of the adapter.

        Raises:
            ValueError: the adapter does not fit this engine (rank, modules).
        """
        raise ValueError(f"{type(self).__name__} cannot load LoRA adapters")

    @abstractmethod
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The engine's current weights by name (tied weights under each name)."""

    def held_tensors(self, names: Iterable[str], adapter: bool) -> dict[str, torch.Tensor] | None:
        """The tensors the engine now holds under the pushed `names` (checkpoint names,
        or PEFT adapter names when `adapter`), in the engine dtype, for the proof of
        delivery (weightsync/verify.py); None when the engine keeps no plain copy
        (vLLM's CPU backend repacks its linears) and only what it was handed can be
        fingerprinted."""
        return None

    def active_adapter(self) -> int | None:
        """The policy_version of the adapter the next `generate` request runs with, or
        None when it runs the base model alone."""
        return None

    def close(self) -> None:
        """Release what outlives the engine object (processes, /dev/shm files); the
        engine is not used after. Default: nothing to release."""
        return None
