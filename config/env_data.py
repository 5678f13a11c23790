"""The data source `{environment: train | eval}`: the prompts of the recipe's
`rollout.environment` dataset (a verifiers environment's `dataset` / `eval_dataset`),
read by recipes/data/environment.py. Pydantic only."""

from __future__ import annotations

from typing import Any, Literal

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


def check_vf1_sources(environment: Any, train: Any, eval_prompts: Any) -> None:
    """Refuse prompts a verifiers v1 environment cannot run: its driver runs the tasks of
    its own taskset (each prompt names its task), which has no eval split.

    Raises:
        ValueError: names the key and what to set.
    """
    if getattr(environment, "type", None) != "verifiers" or environment.api != "v1":
        return
    for key, block in (("data.train", train), ("eval.prompts", eval_prompts)):
        if block is None:
            continue
        if not isinstance(block, EnvironmentData) or block.environment != "train":
            raise ValueError(
                f"{key}: rollout.environment (verifiers api: v1) runs the tasks of its own "
                f"taskset, which has no eval split; set {key}: {{environment: train}} (with "
                "limit), or eval: {holdout: N}"
            )
