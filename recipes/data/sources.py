"""From a data block to its items, in one dispatcher (`items_of(block, kind)`): the
mixture recursion, the file reading and the generator lookup happen here once, for every
kind of item an algorithm trains on (`KIND_OF_DATA`, from its facts): prompts
(layouts.PromptRows; pairs.HhPromptRows for hh files), preference pairs (pairs.PairRows)
or SFT conversations (chats.ChatRows), a registry of row readers (`ROW_READERS`);
generated items come from one registry too (generators.GENERATORS).

Mixture (`mix`): an epoch of `size` items (default: every source's rows once), source i
giving round(size · w_i / Σw) of them (largest remainders make the sum exact), drawn
from its rows in a seeded order, repeating them when its share is larger than its rows;
items are renumbered 0..size-1 and shuffled once. When no source sets a `weight`, w_i is
source i's row count, so without `size` every row is drawn exactly once.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from ...config import FileData, GeneratorData, MixtureData, ReasoningGymData, RecipeError
from ...config.env_data import EnvironmentData
from .chats import ChatExample, ChatRows
from .environment import environment_items
from .generators import generated
from .items import PromptItem
from .layouts import PromptRows
from .pairs import HhPromptRows, PairRows, PreferencePair
from .rows import RowReader, read_items

T = TypeVar("T", PromptItem, PreferencePair, ChatExample)

#: The kind of item each `facts.data` (config/facts.py) trains on.
KIND_OF_DATA = {"rollouts": "prompts", "pairs": "pairs", "chat": "chats"}

#: What `items_of` calls with each single source's items, its key path and the source,
#: before a mixture mixes them (load.py: `check_reward_coverage` of prompts).
SourceCheck = Callable[[list[Any], str, Any], None]


def items_of(
    block: Any,
    kind: str,
    key: str = "data.train",
    *,
    system_prompt: str | None = None,
    margin_key: str | None = None,
    check: SourceCheck | None = None,
    environment: Any = None,
) -> tuple[list[Any], int]:
    """The items of a data block (a source or a mixture of them) and how many rows were
    skipped (hh rows that do not split into a pair).

    Args:
        kind: 'prompts' (`PromptItem`), 'pairs' (`PreferencePair`) or 'chats'
            (`ChatExample`); `KIND_OF_DATA[recipe.facts.data]`.
        key: the block's key path (`data.train`, `eval.prompts`, ...), named in errors.
        system_prompt: `model.system_prompt`, which generated chats (tool_chats) begin with.
        margin_key: pairs: each row's key holding the pair's reward-model margin.
        check: called with every single source's items (a mixture's before mixing).
        environment: `rollout.environment`, whose dataset `{environment: ...}` reads.

    Raises:
        RecipeError: an unreadable file or a bad row (named: file, row, key), a source
            that makes another kind of item, or a mixture of pairs whose prompts are
            text in one source and messages in another.
    """
    if isinstance(block, MixtureData):
        parts = [
            items_of(
                s,
                kind,
                f"{key}.mixture.{i}",
                system_prompt=system_prompt,
                margin_key=margin_key,
                check=check,
                environment=environment,
            )
            for i, s in enumerate(block.mixture)
        ]
        if kind == "pairs":
            _one_prompt_shape([p for p, _ in parts], key)
        mixed = mix([p for p, _ in parts], mixture_weights(block), block.size, block.seed)
        return mixed, sum(n for _, n in parts)
    if isinstance(block, EnvironmentData):
        if kind != "prompts":
            raise RecipeError(f"{key}: {{environment: ...}} gives prompts, not {kind}")
        items, skipped = (
            environment_items(environment, block.environment, key, block.limit, block.data_source),
            0,
        )
    elif isinstance(block, GeneratorData | ReasoningGymData):
        if kind == "pairs":
            raise RecipeError(
                f"{key}: preference pairs come from files; give {{path: pairs.jsonl}}"
            )
        items, skipped = generated(block, kind, key, system_prompt), 0
    else:
        items, skipped = _file_items(block, kind, key, margin_key)
    if check is not None:
        check(items, key, block)
    return items, skipped


#: The row reader of each kind of item, made for one file block: `(block, key path,
#: margin_key) -> reader` (rows.RowReader).
ROW_READERS: dict[str, Callable[[FileData, str, str | None], RowReader]] = {
    "prompts": lambda b, key, margin: (
        HhPromptRows(b, key) if b.format == "hh" else PromptRows(b, key)
    ),
    "pairs": lambda b, key, margin: PairRows.of(b, key, margin),
    "chats": lambda b, key, margin: ChatRows(key),
}


def _file_items(
    block: FileData, kind: str, key: str, margin_key: str | None
) -> tuple[list[Any], int]:
    """The items of one file or folder: its rows (`rows.read_items`) through the kind's
    row reader (`ROW_READERS`)."""
    _no_split_on_a_file(block, key)
    reader = ROW_READERS[kind](block, key, margin_key)
    return read_items(block.path, block.split, key, reader, block.limit)


def _one_prompt_shape(parts: list[list[PreferencePair]], key: str) -> None:
    """A mixture's pair sources give their prompts in one shape.

    Raises:
        RecipeError: some as chat messages, others as text (DPO and reward models
            tokenise one shape per run).
    """
    chat = [i for i, pairs in enumerate(parts) if pairs[0].is_chat]
    if 0 < len(chat) < len(parts):
        raise RecipeError(
            f"{key}.mixture: sources {chat} give their prompts as chat messages and the "
            "others as text; DPO and reward models tokenise one shape per run: give "
            "every source's prompts in one shape"
        )


def _no_split_on_a_file(block: FileData, key: str) -> None:
    if block.split is not None and Path(block.path).is_file():
        raise RecipeError(
            f"{key}.split: {block.path} is one file, which has no splits; remove split, or "
            "give the folder that holds the splits"
        )


def shares(weights: list[float], size: int) -> list[int]:
    """`size` split in proportion to `weights` (largest remainders; sums to `size`)."""
    total = sum(weights)
    exact = [size * w / total for w in weights]
    out = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (out[i] - exact[i], i))
    for i in by_remainder[: size - sum(out)]:
        out[i] += 1
    return out


def mixture_weights(block: MixtureData) -> list[float] | None:
    """The `weight` of each source of a mixture; None when no source sets one (the
    shares then follow the sources' row counts, `mix`)."""
    if not any("weight" in s.model_fields_set for s in block.mixture):
        return None
    return [s.weight for s in block.mixture]


def mix(parts: list[list[T]], weights: list[float] | None, size: int | None, seed: int) -> list[T]:
    """A mixture of `parts` (module docstring); ids renumbered in the mixed order.
    `weights` None: each part's share is its length (every row once without `size`)."""
    lengths = [len(p) for p in parts]
    size = size or sum(lengths)
    rng, chosen = random.Random(seed), []
    for part, n in zip(parts, shares(weights or lengths, size), strict=True):
        order = list(range(len(part)))
        rng.shuffle(order)
        chosen += [part[order[k % len(part)]] for k in range(n)]
    rng.shuffle(chosen)
    field = "prompt_id" if chosen and isinstance(chosen[0], PromptItem) else "pair_id"
    return [replace(item, **{field: i}) for i, item in enumerate(chosen)]
