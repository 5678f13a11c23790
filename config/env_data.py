"""The data source `{environment: train | eval}`: the prompts of the recipe's
`rollout.environment` dataset (a verifiers environment's `dataset` / `eval_dataset`),
read by recipes/data/environment.py. Pydantic only."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict


class EnvironmentData(Strict):
    """`data.train` / `eval.prompts` from `rollout.environment` (type verifiers)."""

    environment: Literal["train", "eval"] = Field(
        description="'train': the environment's dataset; 'eval': its eval_dataset "
        "(its dataset when it has none)."
    )
    limit: int | None = Field(None, gt=0, description="Use only the first N rows.")
    weight: float = Field(1.0, gt=0, description="Inside a mixture: this source's share.")
    data_source: str | None = Field(
        None, description="The rows' data_source; default 'verifiers:<name or module>'."
    )
