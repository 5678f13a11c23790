"""Checks that every training prompt has a reward component to score it
(`check_reward_coverage`, on each source's rows before a mixture draws from them) and
that every source a reward component names is some row's (`check_reward_sources`)."""

from __future__ import annotations

from typing import Any

from ...config import FileData, GeneratorData, ReasoningGymData, RecipeError
from .items import PromptItem


def check_reward_coverage(
    items: list[PromptItem], rewards: list[Any], key: str = "data.train", source: Any = None
) -> None:
    """Every prompt of one source (`key`, `source`: its block) has a reward component
    that applies to it (`sources` names its `data_source`, or lists none), and the
    components it has can score it: `math` needs a ground truth, `reasoning_gym` a
    reasoning-gym row.

    Raises:
        RecipeError: names the row (file and row) and the key to change.
    """
    named = sorted({s for c in rewards for s in c.sources or []})
    for item in items:
        data_source = item.metadata.get("data_source")
        applies = [
            (i, c) for i, c in enumerate(rewards) if c.sources is None or data_source in c.sources
        ]
        if not applies:
            raise RecipeError(
                f"{item.origin}: data_source {data_source!r} is in no reward component's "
                f"sources ({named}), so nothing would score it; add it to a component's "
                "sources, or add a component without sources"
            )
        for i, c in applies:
            if c.type == "reasoning_gym" and "reasoning_gym" not in item.metadata:
                raise RecipeError(
                    f"{item.origin}: rewards.{i} ({c.name!r}, type reasoning_gym) scores only "
                    f"rows of reasoning_gym sources, and this row ({key}, data_source "
                    f"{data_source!r}) is not one; set rewards.{i}.sources to the "
                    "reasoning-gym data_source"
                )
            if c.type == "math" and not item.ground_truth:
                leave_out = (
                    f", or set rewards.{i}.sources to leave its data_source ({data_source!r}) out"
                    if data_source is not None
                    else ""
                )
                raise RecipeError(
                    f"{item.origin}: rewards.{i} ({c.name!r}, type math) compares the "
                    f"response with the row's ground truth, and this row of {key} has none; "
                    f"{_ground_truth_fix(key, source)}{leave_out}"
                )


def _ground_truth_fix(key: str, source: Any) -> str:
    """How a source whose row has no ground truth gets one, or what scores it instead."""
    if isinstance(source, FileData) and source.format != "hh":
        return f"set {key}.answer_key to the key of the reference answer"
    if isinstance(source, FileData):
        return (
            f"{key} (format hh) gives dialogues, no reference answers: score it with a "
            "reward that needs none (type reward_model, judge or length)"
        )
    if isinstance(source, GeneratorData) and source.generator == "python_functions":
        return (
            f"{key} (generator python_functions) gives tests, not reference answers: "
            "score it with type: code"
        )
    if isinstance(source, ReasoningGymData):
        return (
            f"reasoning-gym's {source.reasoning_gym} ({key}) gave this row no answer: "
            "score it with type: reasoning_gym (the dataset's own score_answer)"
        )
    return f"give {key} rows with a reference answer"


def check_reward_sources(items: list[PromptItem], rewards: list[Any]) -> None:
    """Every name in a reward component's `sources` list is some row's data_source.

    Raises:
        RecipeError: names the misspelt sources and the data's.
    """
    named = {s for c in rewards for s in c.sources or []}
    seen = {item.metadata.get("data_source") for item in items}
    unused = sorted(named - seen)
    if unused:
        raise RecipeError(
            f"rewards: sources {unused} match no row's data_source (the data has "
            f"{sorted(str(s) for s in seen if s is not None)}); fix their spelling"
        )
