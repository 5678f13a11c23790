"""The `eval:` block: evaluation of the policy on held-out prompts during training,
pydantic only (recipes/evaluation.py runs it)."""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import Strict
from .data import MAX_SAMPLES, TrainSource, check_weights_in_mixtures


class EvalConfig(Strict):
    """Sample `k` responses per held-out prompt on the rollout engines between steps,
    score them with the recipe's rewards, and log pass@1, pass@k and avg@k (no training
    on them). Policy version v is evaluated when v % every_steps == 0 and after the last
    step (v = train.steps), so an every_steps past train.steps evaluates the final policy;
    v = 0, before any training, only with before_train."""

    prompts: TrainSource | None = Field(
        None,
        description="Held-out prompts from their own source, in any form data.train "
        "takes: {path: test.parquet}, {generator: arithmetic, seed, size}, "
        "{reasoning_gym: NAME, seed}, a mixture. Training rows whose prompt equals one "
        "of them are left out of training (`posttrain validate` counts them).",
    )
    holdout: int | None = Field(
        None,
        gt=0,
        strict=True,
        description="Instead of `prompts`: hold out this many distinct prompts of "
        "data.train (drawn with data.shuffle_seed) and never train on them.",
    )
    every_steps: int = Field(
        gt=0,
        strict=True,
        description="Evaluate every this many policy versions; the final policy "
        "(train.steps) is always evaluated.",
    )
    before_train: bool = Field(False, description="Also evaluate the initial policy.")
    k: int = Field(
        4, gt=0, strict=True, description="Samples per prompt (pass@k uses all of them)."
    )
    temperature: float = Field(
        1.0, gt=0.0, allow_inf_nan=False, description="Sampling temperature of eval."
    )
    max_new_tokens: int | None = Field(
        None,
        gt=0,
        strict=True,
        description="Response token limit; default rollout.max_new_tokens.",
    )
    limit: int | None = Field(
        None, gt=0, strict=True, description="Evaluate only the first N prompts."
    )
    pass_threshold: float = Field(
        1.0,
        allow_inf_nan=False,  # nan: no sample would ever pass
        description="A sample passes when its reward (or a component's value, for the "
        "per-component pass@k) is at least this; 1.0 suits 0/1 verifiers such as math.",
    )
    seed: int = Field(
        0,
        description="Sampling seed; the same for every evaluation, so "
        "versions are compared on the same draws.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if (self.prompts is None) == (self.holdout is None):
            raise ValueError(
                "give held-out prompts either from their own source (eval.prompts: "
                "{path: test.jsonl}) or as a split of data.train (eval.holdout: N), "
                "exactly one of the two"
            )
        if self.prompts is not None:
            check_weights_in_mixtures(self.prompts, "eval.prompts")
        self._samples_fit()
        return self

    def _samples_fit(self) -> None:
        """eval.k × its prompts (when known here: limit or holdout) is at most MAX_SAMPLES."""
        key = "eval.limit" if self.limit else "eval.holdout" if self.holdout else None
        n = self.k * (self.limit or self.holdout or 1)
        if n > MAX_SAMPLES:
            what = f"eval.k × {key} is {n:,}" if key else f"eval.k is {n:,}"
            raise ValueError(
                f"{what} samples an evaluation, more than the {MAX_SAMPLES:,} one may draw; "
                "lower eval.k (pass@k is unbiased for any k ≤ the samples drawn) or "
                "eval.limit"
            )
