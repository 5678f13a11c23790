"""Data made in code, in one registry (`GENERATORS`): each generator's name (a block's
`generator`, or `reasoning_gym` for a reasoning-gym dataset by name), the kind of item it
makes (prompts or chats) and the function that makes them.

- `arithmetic`: reasoning-gym's basic_arithmetic problems (prompts);
- `python_functions`: short Python functions to write (recipes/data/tasks/functions.py;
  prompts, scored by the `code` reward);
- `tool_chats`: the arithmetic problems as tool-use conversations in the format the
  python tool of `grpo_tool_arith.yaml` parses (recipes/episodes/tools.py; SFT chats);
- `reasoning_gym`: any reasoning-gym dataset by name (prompts, scored by the
  `reasoning_gym` reward).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from ...config import GeneratorData, ReasoningGymData, RecipeError
from .chats import ChatExample
from .items import PromptItem, chat_messages


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
    """`cfg.size` Python functions to write (recipes/data/tasks/functions.py); each item's
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
            f"{f'; did you mean {close}' if close else ''}; it has {len(DATASETS)}: "
            f"{', '.join(sorted(DATASETS))}"
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


def tool_call_text(code: str) -> str:
    """An assistant turn calling the python tool, exactly as recipes/episodes/tools.py
    parses it and as grpo_tool_arith.yaml's system prompt shows it."""
    call = {"name": "python", "arguments": {"code": code}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def tool_chats(cfg: GeneratorData, system_prompt: str | None) -> list[ChatExample]:
    """The arithmetic problems of `cfg` as tool-use conversations: the RL prompt (system
    prompt, question) → `print(expression)` as a tool call → its output as a `tool`
    message (what the sandbox prints: the value and a newline) → the number alone."""
    out = []
    for item in arithmetic(cfg):
        expr = item.metadata["expression"]
        messages = chat_messages(item, system_prompt) + [
            {"role": "assistant", "content": tool_call_text(f"print({expr})")},
            {"role": "tool", "content": f"{item.ground_truth}\n"},
            {"role": "assistant", "content": item.ground_truth},
        ]
        out.append(ChatExample(messages, f"tool_chats #{item.prompt_id}"))
    return out


class Generator(NamedTuple):
    """A registry entry: the kind of item it makes ('prompts', 'chats') and
    `make(block, key, system_prompt) -> items`."""

    kind: str
    make: Callable[[Any, str, str | None], list[Any]]


GENERATORS: dict[str, Generator] = {
    "arithmetic": Generator("prompts", lambda cfg, key, system: arithmetic(cfg)),
    "python_functions": Generator("prompts", lambda cfg, key, system: functions(cfg)),
    "tool_chats": Generator("chats", lambda cfg, key, system: tool_chats(cfg, system)),
    "reasoning_gym": Generator("prompts", lambda cfg, key, system: gym_prompts(cfg, key)),
}


def generated(
    block: GeneratorData | ReasoningGymData, kind: str, key: str, system_prompt: str | None
) -> list[Any]:
    """The items a generator block makes (`GENERATORS`), of the `kind` the run wants.

    Raises:
        RecipeError: the generator makes another kind (names `key` and both kinds), or
            reasoning-gym refuses the dataset or its settings.
    """
    name = block.generator if isinstance(block, GeneratorData) else "reasoning_gym"
    gen = GENERATORS[name]
    if gen.kind != kind:
        raise RecipeError(
            f"{key}: {name} makes {gen.kind}, and this algorithm trains on {kind}; give a "
            f"source of {kind}"
        )
    return gen.make(block, key, system_prompt)
