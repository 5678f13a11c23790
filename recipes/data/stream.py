"""The stream of prompts a run draws from (`PromptStream`): `per_step` at a time,
reshuffled at every epoch boundary, resumable from a checkpoint."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ...config import RecipeError
from .items import PromptItem


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
        #: a checkpoint's saved samples of pending prompts and their count (`prefixes`,
        #: `regenerated`: the asynchronous loop's, recipes/async_loop/inflight.py)
        self.carried: dict[str, Any] = {}
        if state is not None:
            self.carried = {k: state[k] for k in ("prefixes", "regenerated") if k in state}
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
