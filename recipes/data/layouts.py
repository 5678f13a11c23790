"""How a file's rows become prompts (`PromptRows`, the prompts' row reader): the layouts
of verl, TRL and plain prompt files, read with no mapping.

The layout is read from row 1 (with `prompt_key: auto`):
- `prompt`: text, or chat messages (verl's RL parquet; TRL's prompt-only and
  prompt-completion datasets, standard or conversational);
- `messages`: a whole conversation (TRL's language-modelling layout); its last
  assistant turn is dropped from the prompt (and is the ground truth when nothing else
  gives one);
- `chosen` / `rejected` without `prompt`: their shared start (TRL's implicit prompt);
- `question`: text (GSM8K).
Every later row must have the same key. Ground truth (`answer_key: auto`): the first of
`reward_model.ground_truth` (verl), `answer`, `ground_truth`, `solution`, `completion`
row 1 has. The row's other keys travel as metadata to the reward services, with
`data_source` (the row's own, else the source's `data_source`) and `extra_info` a
mapping (a null one becomes {}, as verl passes it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ...config import FileData, RecipeError
from .items import Message, PromptItem, check_messages, show
from .pairs import implicit_fields
from .rows import RowReader

GROUND_TRUTH_KEYS = (
    "reward_model.ground_truth",
    "answer",
    "ground_truth",
    "solution",
    "completion",
)
_REPLY = "<the last assistant turn of messages>"


@dataclass(frozen=True)
class Layout:
    """Where a file's prompt and answer are: `prompt` (its key), `kind` ('prompt':
    text or messages; 'messages': a conversation whose last assistant turn is dropped;
    'pairs': the shared start of chosen / rejected), `answer` (its key, `_REPLY`, or
    None) and whether each was picked automatically."""

    prompt: str
    kind: str
    answer: str | None
    auto_prompt: bool
    auto_answer: bool


def lookup(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    """`(found, value)` of `key` in `row`; a dotted key reaches into mappings
    (`reward_model.ground_truth`) when the row has no key spelled so."""
    if key in row:
        return True, row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def resolve_layout(
    cfg: FileData, row: dict[str, Any], where: str, key: str = "data.train"
) -> Layout:
    """The layout of a file from its first row (see the module docstring).

    Raises:
        RecipeError: `prompt_key: auto` and the row has no key a prompt is found under.
    """
    prompt, kind = cfg.prompt_key, "messages" if cfg.prompt_key == "messages" else "prompt"
    if cfg.prompt_key == "auto":
        if "prompt" in row:
            prompt = "prompt"
        elif "messages" in row:
            prompt, kind = "messages", "messages"
        elif cfg.chosen_key in row and cfg.rejected_key in row:
            prompt, kind = f"{cfg.chosen_key}/{cfg.rejected_key}", "pairs"
        elif "question" in row:
            prompt = "question"
        else:
            raise RecipeError(
                f"{where}: no prompt: the row has none of 'prompt', 'messages', 'question' "
                f"or {cfg.chosen_key!r}/{cfg.rejected_key!r}; its keys are {sorted(row)}; "
                f"set {key}.prompt_key to the key of the prompt"
            )
    answer = cfg.answer_key
    if cfg.answer_key == "auto":
        found = [k for k in GROUND_TRUTH_KEYS if k != prompt and lookup(row, k)[0]]
        answer = found[0] if found else _REPLY if kind == "messages" else None
    return Layout(prompt, kind, answer, cfg.prompt_key == "auto", cfg.answer_key == "auto")


def _prompt(
    cfg: FileData, lay: Layout, row: dict[str, Any], where: str, key: str
) -> tuple[str, list[Message] | None, str | None]:
    """The row's prompt text, its messages (None for a text prompt without a system
    message), and the reply a `messages` row ends with."""
    if lay.kind == "pairs":
        prompt = implicit_fields(row, where, cfg.chosen_key, cfg.rejected_key, key)[0]
        value: Any = prompt
    elif lay.prompt not in row:
        picked = " (picked from row 1: prompt_key auto)" if lay.auto_prompt else ""
        raise RecipeError(
            f"{where}: row has no key {lay.prompt!r} ({key}.prompt_key{picked}); its "
            f"keys are {sorted(row)}; fix or drop this row, or set {key}.prompt_key to "
            "the key every row has"
        )
    else:
        value = row[lay.prompt]
    reply = None
    if isinstance(value, list) and lay.kind == "messages" and value:
        last = value[-1]
        if isinstance(last, dict) and last.get("role") == "assistant":
            value, reply = value[:-1], last.get("content")
    if isinstance(value, list | tuple):
        messages: list[Message] | None = check_messages(value, where, lay.prompt)
        text = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        finite_or_raise(value, f"{where}: {lay.prompt!r} ({key}.prompt_key)")
        text, messages = str(value), None
        if not text.strip():
            raise RecipeError(
                f"{where}: {lay.prompt!r} ({key}.prompt_key) is an empty prompt ({show(value)})"
            )
    else:
        raise RecipeError(
            f"{where}: {lay.prompt!r} ({key}.prompt_key) is {show(value)}; it must be "
            "text (or a number) or a list of {role, content} messages"
        )
    if cfg.system_key is not None:
        system = row.get(cfg.system_key)
        if not isinstance(system, str) or not system.strip():
            raise RecipeError(
                f"{where}: {cfg.system_key!r} ({key}.system_key) is "
                f"{show(system) if cfg.system_key in row else 'missing'}; it must be text"
            )
        base = messages or [{"role": "user", "content": text}]
        if base[0]["role"] == "system":
            raise RecipeError(
                f"{where}: {lay.prompt!r} has its own system message and "
                f"{cfg.system_key!r} ({key}.system_key) gives another; keep one"
            )
        messages = [{"role": "system", "content": system}, *base]
    return text, messages, reply


def _answer(
    cfg: FileData, lay: Layout, row: dict[str, Any], where: str, reply: Any, key: str
) -> str:
    if lay.answer is None:
        return ""
    if lay.answer == _REPLY:
        value: Any = reply if isinstance(reply, str) else ""
    else:
        found, value = lookup(row, lay.answer)
        picked = " (picked from row 1: answer_key auto)" if lay.auto_answer else ""
        if not found:
            raise RecipeError(
                f"{where}: row has no key {lay.answer!r} ({key}.answer_key{picked}); "
                f"its keys are {sorted(row)}; fix or drop this row, or set "
                f"{key}.answer_key to the key every row has (null: no answer)"
            )
        one = check_reply(value)
        if one is not None:
            value = one
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise RecipeError(
                f"{where}: {lay.answer!r} ({key}.answer_key{picked}) is {show(value)}; "
                "it must be text (or a number)"
            )
        finite_or_raise(value, f"{where}: {lay.answer!r} ({key}.answer_key{picked})")
    answer = str(value)
    if cfg.answer_delimiter and cfg.answer_delimiter in answer:
        answer = answer.rsplit(cfg.answer_delimiter, 1)[1].strip()
    return answer


def finite_or_raise(value: Any, what: str) -> None:
    """Refuse a float that is NaN or infinite anywhere in `value` (a JSON value from a
    data file): `str()` would make a prompt or answer of 'nan', and a reward service
    would get invalid JSON.

    Raises:
        RecipeError: naming `what` (file, row and key) and the fix.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"{what} is {value}, not a finite number; fix or drop the row")
    if isinstance(value, dict):
        for k, v in value.items():
            finite_or_raise(v, f"{what}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            finite_or_raise(v, f"{what}[{i}]")


def check_reply(value: Any) -> str | None:
    """The content of a conversational completion (a list of one assistant message)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        if value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str):
            return value[0]["content"]
    return None


def _metadata(cfg: FileData, lay: Layout, row: dict[str, Any], where: str) -> dict[str, Any]:
    """The row's other keys (JSON-safe), with `data_source`."""
    used = {lay.prompt, cfg.system_key} | ({lay.answer} if lay.answer in row else set())
    if lay.kind == "pairs":
        used |= {cfg.chosen_key, cfg.rejected_key}
    meta = {k: v for k, v in row.items() if k not in used}
    for k, v in meta.items():  # handed to the reward services
        finite_or_raise(v, f"{where}: {k!r}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError):  # dates, bytes: the reward services get them as text
        meta = json.loads(json.dumps(meta, default=str))
    # verl hands a reward function `extra_info` as a mapping, {} for a null one
    if "extra_info" in meta and meta["extra_info"] is None:
        meta["extra_info"] = {}
    elif "extra_info" in meta and not isinstance(meta["extra_info"], dict):
        raise RecipeError(
            f"{where}: 'extra_info' is {show(meta['extra_info'])}; verl's layout and "
            "python rewards read it as a mapping: give an object (or null), or rename "
            "the column"
        )
    source = meta.get("data_source")
    if source is None and cfg.data_source is not None:
        meta["data_source"] = cfg.data_source
    elif source is not None and not isinstance(source, str):
        raise RecipeError(f"{where}: 'data_source' is {show(source)}; it must be text")
    return meta


class PromptRows(RowReader):
    """The row reader of prompts (`rows.read_items`): each row of one file as a
    `PromptItem` in the file's layout, resolved from its first row (module docstring);
    `key` is the block's key path, named in errors."""

    def __init__(self, cfg: FileData, key: str = "data.train"):
        self.cfg, self.key = cfg, key
        self.layout: Layout | None = None

    def __call__(self, row: dict[str, Any], where: str, n: int) -> PromptItem:
        """Row `where` as prompt number `n`.

        Raises:
            RecipeError: a missing key, a value of the wrong type, an empty prompt,
                messages out of order or with an unknown role or key; names the file,
                the row and the key.
        """
        cfg, key = self.cfg, self.key
        lay = self.layout = self.layout or resolve_layout(cfg, row, where, key)
        text, messages, reply = _prompt(cfg, lay, row, where, key)
        answer = _answer(cfg, lay, row, where, reply, key)
        return PromptItem(n, text, answer, _metadata(cfg, lay, row, where), messages, where)

    def empty(self, path: Any, skipped: int) -> RecipeError:
        """The error for a file with no rows."""
        return RecipeError(
            f"{self.key}.path: {path} has no rows; give a file with at least one prompt"
        )
