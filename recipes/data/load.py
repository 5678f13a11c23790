"""A recipe's data, loaded and checked before anything starts (`load_data`): the items
of its data blocks (sources.items_of) of the kind its algorithm trains on, with held-out
prompts (`eval:`) and pairs (`data.heldout`) kept out of training and every prompt
covered by a reward component (coverage.py). The product never reads `../shared/data`;
recipes ship their samples in recipes/datasets/.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ...config import Recipe
from ...config.data import DataConfig
from .coverage import check_reward_coverage, check_reward_sources
from .items import PromptItem, hold_out, without
from .pairs import PreferencePair
from .sources import KIND_OF_DATA, items_of


def load_prompts(cfg: DataConfig) -> list[PromptItem]:
    """The prompts of `data.train` (all of them: `load_data` leaves held-out ones out).

    Raises:
        RecipeError: unreadable rows or missing keys, naming file, row and key.
    """
    return load_items(cfg.train)


def load_items(block: Any, key: str = "data.train") -> list[PromptItem]:
    """The prompts of one data block (`data.train`, `eval.prompts`): a source or a
    mixture; of hh preference pairs, their single-turn prompts.

    Raises:
        RecipeError: unreadable rows or missing keys, naming file, row and key.
    """
    return items_of(block, "prompts", key)[0]


class LoadedData(NamedTuple):
    """A run's data: `train` (prompts, pairs for `facts.data == "pairs"`, conversations
    for "chat"), `skipped`
    (hh rows whose dialogues do not split), `eval` (held-out prompts) and `held_out`
    (training prompts left out because they equal an evaluation prompt)."""

    train: list[Any]
    skipped: int
    eval: list[PromptItem]
    held_out: int


def load_data(recipe: Recipe) -> LoadedData:
    """A recipe's training data, checked, of the kind its algorithm trains on
    (`KIND_OF_DATA[recipe.facts.data]`): conversations for SFT; preference pairs (those
    whose prompt equals a `data.heldout` pair's left out and counted in `held_out`); else
    prompts with the held-out ones (`eval.prompts`, its first `eval.limit`, or
    `eval.holdout` of data.train's) left out, every prompt covered by a reward component
    that can score it (`check_reward_coverage`, on each source's rows before a mixture
    draws from them).

    Raises:
        RecipeError: an unreadable file or a bad row (named), a row no reward component
            scores, or nothing left to train on.
    """
    kind = KIND_OF_DATA[recipe.facts.data]
    opts: dict[str, Any] = {
        "system_prompt": recipe.model.system_prompt,
        "margin_key": recipe.pair_margin_key,
        "check": _coverage(recipe) if kind == "prompts" else None,
        "environment": recipe.rollout.environment,
    }
    train, skipped = items_of(recipe.data.train, kind, **opts)
    e = recipe.eval if kind == "prompts" else None
    if e is not None and e.holdout is not None:
        kept, held = hold_out(train, e.holdout, recipe.data.shuffle_seed)
        held = held[: e.limit]
    else:
        key = "data.heldout" if kind == "pairs" else "eval.prompts"
        block = recipe.data.heldout if kind == "pairs" else e.prompts if e is not None else None
        held = [] if block is None else items_of(block, kind, key, **opts)[0]
        held = held[: e.limit] if e is not None else held
        kept = without(train, held, key)
    if kind == "prompts":
        check_reward_sources(kept + held, recipe.rewards)
    return LoadedData(kept, skipped, held if kind == "prompts" else [], len(train) - len(kept))


def _coverage(recipe: Recipe) -> Any:
    """The check `items_of` runs on each prompt source (`check_reward_coverage`)."""

    def covered(items: list[PromptItem], key: str, source: Any) -> None:
        check_reward_coverage(items, recipe.rewards, key, source)

    return covered


def load_heldout_pairs(recipe: Recipe) -> list[PreferencePair]:
    """The held-out preference pairs of a DPO or reward-model recipe (`data.heldout`);
    [] without it.

    Raises:
        RecipeError: an unreadable file or a bad row (named).
    """
    if recipe.data.heldout is None:
        return []
    block, margin = recipe.data.heldout, recipe.pair_margin_key
    return items_of(block, "pairs", "data.heldout", margin_key=margin)[0]


def load_eval_prompts(recipe: Recipe) -> list[PromptItem]:
    """The held-out prompts (`eval.prompts`, or `eval.holdout` of data.train's; the
    first `eval.limit`); [] without `eval`.

    Raises:
        RecipeError: as `load_data`.
    """
    e = recipe.eval
    if e is None:
        return []
    if e.holdout is not None:
        return load_data(recipe).eval
    env = recipe.rollout.environment
    return items_of(e.prompts, "prompts", "eval.prompts", environment=env)[0][: e.limit]
