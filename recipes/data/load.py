"""A recipe's training data, loaded and checked before anything starts
(`load_data`), and the stream of prompts a run draws from (`PromptStream`).

Sources (recipes/sources.py): procedural tasks, reasoning-gym datasets and files in
verl's, TRL's and plain layouts (recipes/layouts.py, recipes/rows.py), preference pairs
(recipes/preference.py), and weighted mixtures of them. Held-out prompts (`eval:`) never
appear in training. The product never reads `../shared/data`; recipes ship their
samples in recipes/datasets/.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..config import Recipe, RecipeError
from ..config.data import DataConfig
from .items import PromptItem
from .preference import PreferencePair
from .sources import (
    check_reward_coverage,
    check_reward_sources,
    hold_out,
    source_pairs,
    source_prompts,
    without,
)


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
    return source_prompts(block, key)


class PromptStream:
    """`per_step` prompts at a time, reshuffled at every epoch boundary; resumable.

    Epoch e reads the (e+1)-th shuffle of `random.Random(seed)` from its last item to its
    first. `state()` is the position (`epoch`, `index` of the next prompt in that epoch's
    `order` of item positions, and `pending`: positions of prompts drawn before the
    checkpoint but not trained on, served again first); `PromptStream(items, per_step,
    seed, state)` continues from it. `drawn` holds the item positions of the last batch.
    """

    def __init__(
        self, items: list[PromptItem], per_step: int, seed: int, state: dict[str, Any] | None = None
    ):
        self.items, self.per_step = items, per_step
        self.rng = random.Random(seed)
        self.epoch, self.index = 0, 0
        self.order = self._shuffle()
        self.pending: list[int] = []  # positions served before the order continues
        self.drawn: list[int] = []
        if state is not None:
            for _ in range(state["epoch"]):
                self.order = self._shuffle()
            if self.order != state["order"]:
                raise RecipeError(
                    f"the checkpoint's data stream shuffled {len(state['order'])} "
                    f"prompts, this run has {len(items)}; resume with the same data"
                )
            self.epoch, self.index = state["epoch"], state["index"]
            self.pending = [int(i) for i in state.get("pending", [])]
            if any(not 0 <= i < len(items) for i in self.pending):
                raise RecipeError(
                    f"the checkpoint's data stream has pending prompt positions "
                    f"{self.pending} outside this run's {len(items)} prompts; resume with "
                    "the same data"
                )

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.items)))
        self.rng.shuffle(order)
        return order[::-1]

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> list[PromptItem]:
        self.drawn = []
        while len(self.drawn) < self.per_step:
            if self.pending:
                self.drawn.append(self.pending.pop(0))
                continue
            if self.index == len(self.order):
                self.order, self.epoch, self.index = self._shuffle(), self.epoch + 1, 0
            self.drawn.append(self.order[self.index])
            self.index += 1
        return [self.items[i] for i in self.drawn]

    def state(self, untrained: Sequence[int] = ()) -> dict[str, Any]:
        """The position to resume from (JSON-able); `untrained` (positions of prompts
        drawn but not trained on: the asynchronous loop's buffered and in-flight ones)
        go first in its `pending`, before those not served again yet."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "order": list(self.order),
            "pending": [*untrained, *self.pending],
        }


def prompt_stream(
    items: list[PromptItem], per_step: int, seed: int, state: dict[str, Any] | None = None
) -> PromptStream:
    """Yield `per_step` prompts at a time, reshuffling at every epoch boundary (see
    `PromptStream`; `state` resumes a stream's `state()`)."""
    return PromptStream(items, per_step, seed, state)


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
    """A recipe's training data, checked: preference pairs for an algorithm that trains
    on pairs (`recipe.facts.data`; those whose prompt equals a `data.heldout` pair's are
    left out and counted in `held_out`), else prompts with the held-out ones (`eval.prompts`,
    or `eval.holdout` of data.train's) left out, every prompt covered by a reward
    component that can score it (`sources.check_reward_coverage`, on each source's rows
    before a mixture draws from them).

    Raises:
        RecipeError: an unreadable file or a bad row (named), or a row no reward
            component scores.
    """
    if recipe.facts.data == "chat":
        from .chats import source_chats

        return LoadedData(source_chats(recipe.data.train, recipe.model.system_prompt), 0, [], 0)
    if recipe.facts.data == "pairs":
        pairs, skipped = source_pairs(recipe.data.train, recipe.pair_margin_key)
        held = {json.dumps(p.prompt) for p in load_heldout_pairs(recipe)}
        kept = [p for p in pairs if json.dumps(p.prompt) not in held]
        return LoadedData(kept, skipped, [], len(pairs) - len(kept))

    def covered(items: list[PromptItem], key: str, source: Any) -> None:
        check_reward_coverage(items, recipe.rewards, key, source)

    e = recipe.eval
    train, evals, dropped = source_prompts(recipe.data.train, check=covered), [], 0
    if e is not None and e.holdout is not None:
        kept, evals = hold_out(train, e.holdout, recipe.data.shuffle_seed)
        train, dropped = kept, len(train) - len(kept)
    elif e is not None:
        evals = source_prompts(e.prompts, "eval.prompts", check=covered)[: e.limit]
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
    return source_pairs(recipe.data.heldout, recipe.pair_margin_key, "data.heldout")[0]


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
    return source_prompts(e.prompts, "eval.prompts")[: e.limit]
