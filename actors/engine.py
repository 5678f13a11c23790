"""The interface every inference engine behind a `RolloutWorker` implements.

An engine owns one model replica. It samples, loads new weights in place, and can
checksum what it holds. Engines are used by one thread at a time (the worker's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from posttrain.actors.rollout import FinishReason, SamplingSettings


@dataclass(frozen=True)
class Sample:
    """One engine output: `[R]` token ids and their logprobs under temperature."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass(frozen=True)
class EngineSettings:
    """Plain values that build one engine (from the recipe's `rollout` and `model`).

    Attributes:
        kind: 'vllm' or 'hf'.
        model_path: transformers folder.
        dtype: 'bfloat16' or 'float32'.
        seed: engine seed.
        kv_cache_gb: vLLM KV cache, GiB.
        max_model_len: vLLM's longest prompt + response, tokens (None: the model's).
        enforce_eager: vLLM without torch.compile / CUDA graphs.
        device: 'cpu' or 'cuda'.
        lora_rank: with adapter-only weight sync, the adapter's rank (the engine serves
            base + the newest LoRA adapter); None otherwise.
    """

    kind: Literal["vllm", "hf"]
    model_path: str
    dtype: str = "bfloat16"
    seed: int = 0
    kv_cache_gb: float = 1.0
    max_model_len: int | None = None
    enforce_eager: bool = True
    device: str = "cpu"
    lora_rank: int | None = None


class InferenceEngine(ABC):
    """Sampling engine of one rollout worker."""

    #: a transformers tokenizer with the model's chat template; set by each engine.
    tokenizer: Any

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

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy `(name, tensor)` pairs into the model in place; returns the names loaded.

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

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], config: dict,
                     version: int) -> list[str]:
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
