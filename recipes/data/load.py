"""A recipe's data, loaded and checked before anything starts (`load_data`): the items
of its data blocks (sources.items_of) of the kind its algorithm trains on, with held-out
prompts (`eval:`) and pairs (`data.heldout`) kept out of training and every prompt
covered by a reward component (coverage.py). The product never reads `../shared/data`;
recipes ship their samples in recipes/datasets/.
"""

from __future__ import annotations

import json
import random
from typing import Any, NamedTuple

from ...config import Recipe, RecipeError
from ...config.data import DataConfig
from .coverage import check_reward_coverage, check_reward_sources
from .items import PromptItem, prompt_identity
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
    (`recipe.facts.data`): conversations for SFT; preference pairs (those whose prompt
    equals a `data.heldout` pair's left out and counted in `held_out`); else prompts with
    the held-out ones (`eval.prompts`, or `eval.holdout` of data.train's) left out, every
    prompt covered by a reward component that can score it (`check_reward_coverage`, on
    each source's rows before a mixture draws from them).

    Raises:
        RecipeError: an unreadable file or a bad row (named), or a row no reward
            component scores.
    """
    kind = KIND_OF_DATA[recipe.facts.data]
    if kind == "chats":
        chats = items_of(recipe.data.train, kind, system_prompt=recipe.model.system_prompt)[0]
        return LoadedData(chats, 0, [], 0)
    if kind == "pairs":
        pairs, skipped = items_of(recipe.data.train, kind, margin_key=recipe.pair_margin_key)
        held = {json.dumps(p.prompt) for p in load_heldout_pairs(recipe)}
        kept = [p for p in pairs if json.dumps(p.prompt) not in held]
        return LoadedData(kept, skipped, [], len(pairs) - len(kept))

    def covered(items: list[PromptItem], key: str, source: Any) -> None:
        check_reward_coverage(items, recipe.rewards, key, source)

    e = recipe.eval
    train, evals, dropped = items_of(recipe.data.train, kind, check=covered)[0], [], 0
    if e is not None and e.holdout is not None:
        kept, evals = hold_out(train, e.holdout, recipe.data.shuffle_seed)
        train, dropped = kept, len(train) - len(kept)
    elif e is not None:
        evals = items_of(e.prompts, kind, "eval.prompts", check=covered)[0][: e.limit]
        train, dropped = without(train, evals)
    if e is not None:
        evals = evals[: e.limit]
    check_reward_sources(train + evals, recipe.rewards)
    return LoadedData(train, 0, evals, dropped)


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
    return items_of(e.prompts, "prompts", "eval.prompts")[0][: e.limit]


def hold_out(
    items: list[PromptItem], n: int, seed: int
) -> tuple[list[PromptItem], list[PromptItem]]:
    """`(training, held out)`: `n` distinct prompts drawn with `seed`, every training item
    with one of those prompts moved out of training.

    Raises:
        RecipeError: fewer than n + 1 distinct prompts (nothing would be left to train on).
    """
    first: dict[str, PromptItem] = {}
    for item in items:
        first.setdefault(prompt_identity(item), item)
    if n >= len(first):
        raise RecipeError(
            f"eval.holdout: {n} prompts held out of data.train, which has {len(first)} "
            f"distinct prompts; hold out fewer than {len(first)}"
        )
    keys = sorted(first)
    random.Random(seed).shuffle(keys)
    held = set(keys[:n])
    return [i for i in items if prompt_identity(i) not in held], [first[k] for k in keys[:n]]


def without(items: list[PromptItem], held: list[PromptItem]) -> tuple[list[PromptItem], int]:
    """`items` less those whose prompt equals a held-out prompt, and how many left."""
    keys = {prompt_identity(h) for h in held}
    kept = [i for i in items if prompt_identity(i) not in keys]
    if not kept:
        raise RecipeError(
            "eval.prompts: every prompt of data.train is also an evaluation prompt, so "
            "none is left to train on; evaluate on other prompts"
        )
    return kept, len(items) - len(kept)
