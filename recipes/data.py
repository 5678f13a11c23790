"""Prompt sources for RL recipes: procedural tasks, jsonl files, and the single-turn
prompts of HH-RLHF preference pairs.

Each source yields `PromptItem`s (controller-side only). The product never reads
`../shared/data`; recipes that point there are for tests and benchmarks.
"""

from __future__ import annotations

import json
import random
from typing import Any

from ..config import Recipe, RecipeError
from ..config.data import DataConfig, GeneratorData, JsonlData, PreferenceData
from .items import PromptItem, jsonl_rows
from .preference import load_pairs, pair_prompts


def _arithmetic(cfg: GeneratorData) -> list[PromptItem]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset(
        "basic_arithmetic",
        size=cfg.size,
        seed=cfg.seed,
        min_terms=cfg.min_terms,
        max_terms=cfg.max_terms,
        min_digits=cfg.min_digits,
        max_digits=cfg.max_digits,
        operators=tuple(cfg.operators),
        allow_negation=False,
        allow_parentheses=False,
    )
    return [
        PromptItem(
            i, row["question"], str(row["answer"]), {"expression": row["metadata"]["expression"]}
        )
        for i, row in enumerate(ds)
    ]


def _jsonl(cfg: JsonlData) -> list[PromptItem]:
    items: list[PromptItem] = []
    for lineno, row in jsonl_rows(cfg.path):
        if not isinstance(row, dict):
            raise RecipeError(
                f"{cfg.path}:{lineno}: a row must be a JSON object with "
                f"{cfg.prompt_key!r}, got {type(row).__name__}"
            )
        for key, role in ((cfg.prompt_key, "prompt_key"), (cfg.answer_key, "answer_key")):
            if key is None:
                continue
            if key not in row:
                raise RecipeError(
                    f"{cfg.path}:{lineno}: row has no key {key!r} (data.train.{role}); "
                    f"its keys are {sorted(row)}; set data.train.{role} to one of them"
                )
            if not isinstance(row[key], str | int | float) or isinstance(row[key], bool):
                raise RecipeError(
                    f"{cfg.path}:{lineno}: {key!r} (data.train.{role}) is "
                    f"{json.dumps(row[key])[:40]}; it must be text (or a number)"
                )
        answer = "" if cfg.answer_key is None else str(row[cfg.answer_key])
        if cfg.answer_delimiter and cfg.answer_delimiter in answer:
            answer = answer.rsplit(cfg.answer_delimiter, 1)[1].strip()
        meta = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.answer_key)}
        items.append(PromptItem(len(items), str(row[cfg.prompt_key]), answer, meta))
        if cfg.limit and len(items) >= cfg.limit:
            break
    if not items:
        raise RecipeError(f"{cfg.path}: no rows; the training file is empty")
    return items


def load_prompts(cfg: DataConfig) -> list[PromptItem]:
    """Materialise the training prompts of a recipe.

    Raises:
        RecipeError: unreadable rows or missing keys, naming file, line and key.
    """
    return load_items(cfg.train)


def load_items(block: GeneratorData | JsonlData | PreferenceData) -> list[PromptItem]:
    """The prompts of one data block (`data.train`, `eval.prompts`); of hh preference
    pairs, their single-turn prompts (`preference.pair_prompts`).

    Raises:
        RecipeError: unreadable rows or missing keys, naming file, line and key.
    """
    if isinstance(block, GeneratorData):
        return _arithmetic(block)
    if isinstance(block, PreferenceData):
        return pair_prompts(
            load_pairs(
                block.path,
                block.format,
                block.prompt_key,
                block.chosen_key,
                block.rejected_key,
                block.limit,
            )[0]
        )
    return _jsonl(block)


class PromptStream:
    """`per_step` prompts at a time, reshuffled at every epoch boundary; resumable.

    Epoch e reads the (e+1)-th shuffle of `random.Random(seed)` from its last item to its
    first. `state()` is the position (`epoch`, `index` of the next prompt in that epoch's
    `order` of item positions); `PromptStream(items, per_step, seed, state)` continues
    from it.
    """

    def __init__(
        self, items: list[PromptItem], per_step: int, seed: int, state: dict[str, Any] | None = None
    ):
        self.items, self.per_step = items, per_step
        self.rng = random.Random(seed)
        self.epoch, self.index = 0, 0
        self.order = self._shuffle()
        if state is not None:
            for _ in range(state["epoch"]):
                self.order = self._shuffle()
            if self.order != state["order"]:
                raise RecipeError(
                    f"the checkpoint's data stream shuffled {len(state['order'])} "
                    f"prompts, this run has {len(items)}; resume with the same data"
                )
            self.epoch, self.index = state["epoch"], state["index"]

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.items)))
        self.rng.shuffle(order)
        return order[::-1]

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> list[PromptItem]:
        batch: list[PromptItem] = []
        while len(batch) < self.per_step:
            if self.index == len(self.order):
                self.order, self.epoch, self.index = self._shuffle(), self.epoch + 1, 0
            batch.append(self.items[self.order[self.index]])
            self.index += 1
        return batch

    def state(self) -> dict[str, Any]:
        """The position to resume from (JSON-able)."""
        return {"epoch": self.epoch, "index": self.index, "order": list(self.order)}


def prompt_stream(
    items: list[PromptItem], per_step: int, seed: int, state: dict[str, Any] | None = None
) -> PromptStream:
    """Yield `per_step` prompts at a time, reshuffling at every epoch boundary (see
    `PromptStream`; `state` resumes a stream's `state()`)."""
    return PromptStream(items, per_step, seed, state)


def load_data(recipe: Recipe) -> tuple[list[Any], int]:
    """A recipe's training data and how many rows were skipped: preference pairs for an
    algorithm that trains on pairs (`recipe.facts.data`), else prompts (of hh pairs:
    their single-turn prompts, `preference.pair_prompts`).

    Raises:
        RecipeError: an unreadable file or a bad row (named).
    """
    d = recipe.data.train
    if isinstance(d, PreferenceData) and recipe.facts.data == "pairs":
        return load_pairs(
            d.path,
            d.format,
            d.prompt_key,
            d.chosen_key,
            d.rejected_key,
            d.limit,
            recipe.pair_margin_key,
        )
    return load_prompts(recipe.data), 0
