"""The `eval:` block: evaluation of the policy on held-out prompts during training,
pydantic only (recipes/evaluation.py runs it)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Discriminator, Field, Tag

from .base import Strict
from .data import GeneratorData, JsonlData, _data_kind


class EvalConfig(Strict):
    """Sample `k` responses per held-out prompt on the rollout engines between steps,
    score them with the recipe's rewards, and log pass@1, pass@k and avg@k (no training
    on them). Policy version v is evaluated when v % every_steps == 0 (v = 0, before any
    training, only with before_train)."""

    prompts: Annotated[
        Annotated[GeneratorData, Tag("generator")] | Annotated[JsonlData, Tag("jsonl")],
        Discriminator(_data_kind),
    ] = Field(
        description="Held-out prompts, as data.train: {path: test.jsonl, prompt_key, "
        "answer_key} or {generator: arithmetic, seed, size} (use a seed other than "
        "training's)."
    )
    every_steps: int = Field(gt=0, description="Evaluate every this many policy versions.")
    before_train: bool = Field(False, description="Also evaluate the initial policy.")
    k: int = Field(4, gt=0, description="Samples per prompt (pass@k uses all of them).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of eval.")
    max_new_tokens: int | None = Field(
        None, gt=0, description="Response token limit; default rollout.max_new_tokens."
    )
    limit: int | None = Field(None, gt=0, description="Evaluate only the first N prompts.")
    pass_threshold: float = Field(
        1.0,
        description="A sample passes when its reward (or a component's value, for the "
        "per-component pass@k) is at least this; 1.0 suits 0/1 verifiers such as math.",
    )
    seed: int = Field(
        0,
        description="Sampling seed; the same for every evaluation, so "
        "versions are compared on the same draws.",
    )
