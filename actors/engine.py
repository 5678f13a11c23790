"""The interface every inference engine behind a `RolloutWorker` implements.

An engine owns one model replica. It samples, loads new weights in place, and can
checksum what it holds. Engines are used by one thread at a time (the worker's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from actors.rollout import FinishReason, SamplingSettings


@dataclass(frozen=True)
class Sample:
    """One engine output: `[R]` token ids and their logprobs under temperature."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class InferenceEngine(ABC):
    """Sampling engine of one rollout worker."""

    @abstractmethod
    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` under the chat template, with the generation prompt."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Sample]]:
        """`sampling.n` samples per prompt; result[i] holds prompt i's samples in order."""

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids` without special tokens."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy `(name, tensor)` pairs into the model in place; returns the names loaded.

        Raises:
            ValueError: an unknown name, a shape mismatch, or a model parameter left
                without a new value (the engine must never keep stale weights silently).
        """

    @abstractmethod
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The engine's current weights by name (tied weights under each name)."""
