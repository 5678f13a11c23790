"""From a recipe's data blocks to lists of items: each source (a generator, a
reasoning-gym dataset, a file), weighted mixtures of them, held-out prompts kept out of
training, and the check that every row has a reward component to score it.

Mixture (`mix`): an epoch of `size` items (default: every source's rows once), source i
giving round(size · w_i / Σw) of them (largest remainders make the sum exact), drawn
from its rows in a seeded order, repeating them when its share is larger than its rows;
items are renumbered 0..size-1 and shuffled once. When no source sets a `weight`, w_i is
source i's row count, so without `size` every row is drawn exactly once.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from ..config import FileData, GeneratorData, MixtureData, ReasoningGymData, RecipeError
from .items import PromptItem, prompt_identity
from .layouts import file_prompts
from .preference import PreferencePair, load_pairs, pair_prompts

T = TypeVar("T", PromptItem, PreferencePair)


def arithmetic(cfg: GeneratorData) -> list[PromptItem]:
    """reasoning-gym's basic_arithmetic problems (one-line answers), `cfg.size` of them."""
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
    meta = {} if cfg.data_source is None else {"data_source": cfg.data_source}
    return [
        PromptItem(
            i,
            row["question"],
            str(row["answer"]),
            {"expression": row["metadata"]["expression"], **meta},
            origin=f"arithmetic #{i}",
        )
        for i, row in enumerate(ds)
    ]


def functions(cfg: GeneratorData) -> list[PromptItem]:
    """`cfg.size` Python functions to write (recipes/tasks/functions.py); each item's
    metadata is what the `code` reward runs: `code_prefix`, `test`, `entry_point`."""
    from .tasks.functions import python_functions

    meta = {} if cfg.data_source is None else {"data_source": cfg.data_source}
    return [
        PromptItem(
            i,
            p["prompt"],
            "",
            {"code_prefix": p["code_prefix"], "test": p["test"], "entry_point": p["entry_point"]}
            | meta,
            origin=f"python_functions #{i} ({p['name']})",
        )
        for i, p in enumerate(python_functions(cfg.size, cfg.seed))
    ]


def gym_dataset(name: str, seed: int, size: int, config: dict[str, Any], key: str) -> Any:
    """`reasoning_gym.create_dataset(name, seed=, size=, **config)`.

    Raises:
        RecipeError: an unknown name (with the closest names) or settings its config
            class refuses; names `key`.
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        raise RecipeError(
            f"{key}: reasoning-gym has no dataset {name!r}"
            f"{f'; did you mean {close}' if close else ''} (sorted(reasoning_gym.factory."
            "DATASETS) lists them)"
        )
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise RecipeError(
            f"{key}.config: reasoning-gym's {name} refuses {config}: {type(e).__name__}: {e}"
        ) from None


def gym_prompts(cfg: ReasoningGymData, key: str = "data.train") -> list[PromptItem]:
    """The problems of a reasoning-gym dataset; each item's metadata names the dataset,
    its settings and the problem's index, from which the `reasoning_gym` reward makes the
    same problem again to score it (rewards/reasoning_gym.py)."""
    ds = gym_dataset(cfg.reasoning_gym, cfg.seed, cfg.size, cfg.config, key)
    out = []
    for i in range(len(ds)):
        row = ds[i]
        ref = {
            "dataset": cfg.reasoning_gym,
            "seed": cfg.seed,
            "size": cfg.size,
            "config": cfg.config,
            "index": i,
        }
        meta = {"data_source": cfg.source_name, "reasoning_gym": ref}
        answer = "" if row["answer"] is None else str(row["answer"])
        out.append(PromptItem(i, str(row["question"]), answer, meta, origin=f"{key} #{i}"))
    return out


#: What `source_prompts` calls with each single source's prompts, its key path and
#: the source, before a mixture mixes them (`check_reward_coverage`).
SourceCheck = Callable[[list[PromptItem], str, Any], None]


def source_prompts(
    block: Any, key: str = "data.train", check: SourceCheck | None = None
) -> list[PromptItem]:
    """The prompts of one source (or a mixture's); hh preference files give the
    single-turn prompts of their pairs (`preference.pair_prompts`). `check(items, key,
    source)` sees every single source's prompts (a mixture's entries before mixing)."""
    if isinstance(block, MixtureData):
        parts = [
            source_prompts(s, f"{key}.mixture.{i}", check) for i, s in enumerate(block.mixture)
        ]
        return mix(parts, mixture_weights(block), block.size, block.seed)
    items = _single_source_prompts(block, key)
    if check is not None:
        check(items, key, block)
    return items


def _single_source_prompts(block: Any, key: str) -> list[PromptItem]:
    if isinstance(block, GeneratorData):
        return functions(block) if block.generator == "python_functions" else arithmetic(block)
    if isinstance(block, ReasoningGymData):
        return gym_prompts(block, key)
    _no_split_on_a_file(block, key)
    if block.format == "hh":
        pairs = load_pairs(
            block.path,
            "hh",
            chosen_key=block.chosen_key,
            rejected_key=block.rejected_key,
            limit=block.limit,
            block=key,
        )[0]
        items = pair_prompts(pairs, key)
        meta = {} if block.data_source is None else {"data_source": block.data_source}
        return [replace(p, metadata=meta, origin=f"{block.path} pair {p.prompt_id}") for p in items]
    return file_prompts(block, key)


def source_pairs(
    block: Any, margin_key: str | None = None, key: str = "data.train"
) -> tuple[list[PreferencePair], int]:
    """The preference pairs of a file (or a mixture of files) and the hh rows skipped."""
    if isinstance(block, MixtureData):
        parts = [
            source_pairs(s, margin_key, f"{key}.mixture.{i}") for i, s in enumerate(block.mixture)
        ]
        chat = [i for i, (pairs, _) in enumerate(parts) if pairs[0].is_chat]
        if 0 < len(chat) < len(parts):
            raise RecipeError(
                f"{key}.mixture: sources {chat} give their prompts as chat messages and the "
                "others as text; DPO and reward models tokenise one shape per run: give "
                "every source's prompts in one shape"
            )
        mixed = mix([p for p, _ in parts], mixture_weights(block), block.size, block.seed)
        return mixed, sum(n for _, n in parts)
    if not isinstance(block, FileData):
        raise RecipeError(f"{key}: preference pairs come from files; give {{path: pairs.jsonl}}")
    _no_split_on_a_file(block, key)
    return load_pairs(
        block.path,
        block.format,
        block.prompt_key,
        block.chosen_key,
        block.rejected_key,
        block.limit,
        margin_key,
        block.split,
        key,
    )


def _no_split_on_a_file(block: FileData, key: str) -> None:
    from pathlib import Path

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
