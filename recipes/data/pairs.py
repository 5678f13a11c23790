"""Preference pairs for DPO and reward models: `PreferencePair`, the row reader that
makes them (`PairRows`, for any file kind recipes/data/rows.py reads), and their other
shapes (`pair_prompts`: the GRPO / PPO prompts of hh pairs; `as_chat`; `hh_messages`).
Their token ids: recipes/data/pair_tokens.py.

Formats:
- `auto` (and `pairs`, its older name): TRL's preference layouts. With a shared
  `prompt` (key configurable): `prompt`, `chosen`, `rejected`; the replies are the text
  after the prompt. Chat-format rows give the prompt as a list of messages
  `[{"role": ..., "content": ...}, ...]` (checked: roles, order) and each reply as text
  or as a list of one `{"role": "assistant", "content": ...}` message. Without a
  `prompt` column (TRL's implicit prompt): `chosen` and `rejected` are whole
  conversations (the shared leading messages are the prompt, then one assistant
  message each) or whole texts (the shared leading characters are the prompt, as TRL's
  `extract_prompt` splits them). All rows of a file share one prompt shape.
- `hh`: Anthropic HH-RLHF rows `{"chosen", "rejected"}`, each a whole dialogue of
  `\\n\\nHuman: …\\n\\nAssistant: …` turns sharing every turn but the last reply. The
  prompt is the dialogue up to and including the last `\\n\\nAssistant:`; rows whose
  two dialogues do not share that prompt are skipped and counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...common.chat_tokens import shared_start
from ...config import FileData, RecipeError
from .items import Message, PromptItem, check_messages
from .rows import RowReader, read_items

HH_MARK = "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: the same prompt, a preferred and a dispreferred reply (text).
    `prompt` is text, or for chat-format pairs a list of `{"role", "content"}` messages
    (the replies are then the assistant's next turn)."""

    pair_id: int
    prompt: str | list[Message]
    chosen: str
    rejected: str
    margin: float = 0.0  # reward-model margin of this pair (`margin_key`), else 0
    hh: bool = False  # the prompt is HH-RLHF dialogue text (`format: hh`)

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)


def _messages(value: Any) -> list[Message] | None:
    """`value` if it is a non-empty list of `{role: str, content: str, ...}` dicts."""
    if not isinstance(value, list) or not value:
        return None
    ok = all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    return value if ok else None


def _row_fields(
    row: dict, where: str, prompt_key: str, chosen_key: str, rejected_key: str, block: str
) -> tuple[str | list[Message], str, str]:
    """Prompt (text or messages) and the two reply texts of one `pairs` row."""
    prompt = row.get(prompt_key)
    chat = _messages(prompt) is not None
    if not chat and not isinstance(prompt, str):
        _bad_key(row, prompt_key, where, "text or a list of {role, content} messages", block)
    if chat:
        prompt = check_messages(prompt, where, prompt_key)
    elif not prompt.strip():
        raise RecipeError(f"{where}: key {prompt_key!r} is an empty prompt")
    replies = []
    for k in (chosen_key, rejected_key):
        v = row.get(k)
        msgs = _messages(v)
        if isinstance(v, str):
            replies.append(v)
        elif msgs is not None and len(msgs) == 1 and msgs[0]["role"] == "assistant" and chat:
            replies.append(_reply_text(msgs[0], where, k))
        elif msgs is not None and chat:
            raise RecipeError(
                f"{where}: key {k!r} must hold one assistant message, not "
                f"{[m['role'] for m in msgs]}; put earlier turns in {prompt_key!r}"
            )
        elif msgs is not None:
            raise RecipeError(
                f"{where}: key {k!r} is a list of messages but {prompt_key!r} "
                "is text; give the prompt as a list of messages too"
            )
        else:
            _bad_key(row, k, where, "text or a list of one assistant message", block)
    return prompt, replies[0], replies[1]


def implicit_fields(
    row: dict, where: str, chosen_key: str, rejected_key: str, block: str = "data.train"
) -> tuple[str | list[Message], str, str]:
    """TRL's implicit prompt: the shared start of `chosen` and `rejected` (whole texts or
    conversations) is the prompt, the rest of each its reply (TRL `extract_prompt`:
    texts split at the first differing character, a space before it going to the
    replies; conversations at the first differing message, then one assistant message
    each).

    Raises:
        RecipeError: values of the wrong shape, no shared start, or a conversation
            that does not end in one assistant reply each.
    """
    c, r = row.get(chosen_key), row.get(rejected_key)
    for k, v in ((chosen_key, c), (rejected_key, r)):
        if not isinstance(v, str) and _messages(v) is None:
            _bad_key(row, k, where, "text or a list of {role, content} messages", block)
    if isinstance(c, str) != isinstance(r, str):
        raise RecipeError(
            f"{where}: keys {chosen_key!r} and {rejected_key!r} must both be text or both "
            "lists of messages"
        )
    n = shared_start([c, r])
    if isinstance(c, str):
        if 0 < n < len(c) and c[n - 1] == " ":
            n -= 1
        if not c[:n].strip():
            raise RecipeError(
                f"{where}: {chosen_key!r} and {rejected_key!r} share no prompt at their "
                f"start; give the prompt in its own column ({block}.prompt_key)"
            )
        return c[:n], c[n:], r[n:]
    if n == 0:
        raise RecipeError(
            f"{where}: {chosen_key!r} and {rejected_key!r} share no leading messages; give "
            f"the prompt in its own column ({block}.prompt_key)"
        )
    prompt = check_messages(c[:n], where, f"{chosen_key}/{rejected_key} shared start")
    replies = []
    for k, rest in ((chosen_key, c[n:]), (rejected_key, r[n:])):
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            raise RecipeError(
                f"{where}: after the prompt {chosen_key!r} and {rejected_key!r} share, "
                f"{k!r} must hold one assistant message, not {[m['role'] for m in rest]}"
            )
        replies.append(_reply_text(rest[0], where, k))
    return prompt, replies[0], replies[1]


def _reply_text(m: dict, where: str, key: str) -> str:
    """The content of a reply message, which must carry nothing else a chat template
    reads (a pair's replies are text: `reasoning_content` or `tool_calls` would be lost).

    Raises:
        RecipeError: it does; names `where`, `key` and the keys.
    """
    extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v is not None)
    if extra:
        raise RecipeError(
            f"{where}: key {key!r} is an assistant message with {extra} besides its content; "
            "a preference reply is text, so they would be lost: put them in the content "
            "(e.g. <think>...</think> before the answer) or remove them"
        )
    return m["content"]


def _bad_key(row: dict, key: str, where: str, wanted: str, block: str) -> None:
    what = "is missing" if key not in row else f"is {json.dumps(row[key])[:30]}, not {wanted}"
    raise RecipeError(
        f"{where}: key {key!r} {what}; the row's keys are {sorted(row)} "
        f"(see {block}.*_key, {block}.format)"
    )


def _hh_fields(
    row: dict, where: str, chosen_key: str, rejected_key: str, block: str
) -> tuple[str, str, str] | None:
    """Shared prompt and the two last replies of an hh row; None if they do not split."""
    for k in (chosen_key, rejected_key):
        if not isinstance(row.get(k), str):
            _bad_key(row, k, where, "text", block)
    cut = row[chosen_key].rfind(HH_MARK)
    prompt = row[chosen_key][: cut + len(HH_MARK)] if cut >= 0 else ""
    if not prompt or not row[rejected_key].startswith(prompt):
        return None
    return prompt, row[chosen_key][len(prompt) :], row[rejected_key][len(prompt) :]


class PairRows(RowReader):
    """The row reader of preference pairs (`rows.read_items`): each row of one file as a
    `PreferencePair` (None: an hh row that does not split, skipped). `fmt`: 'auto' /
    'pairs' (TRL's layouts; `prompt_key` 'auto': 'prompt' when row 1 has it, else the
    implicit prompt) or 'hh'. `margin_key`: each row's key holding a number ≥ 0, the
    pair's `margin`. `block`: the data block's key path (`data.train`, `data.heldout`,
    `eval.prompts`, a mixture entry), named in errors."""

    def __init__(
        self,
        fmt: str,
        prompt_key: str = "auto",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        margin_key: str | None = None,
        block: str = "data.train",
    ):
        self.fmt, self.prompt_key, self.margin_key, self.block = fmt, prompt_key, margin_key, block
        self.chosen_key, self.rejected_key = chosen_key, rejected_key
        self.implicit: bool | None = None
        self.first: PreferencePair | None = None

    def __call__(self, row: dict[str, Any], where: str, n: int) -> PreferencePair | None:
        """Row `where` as pair number `n`.

        Raises:
            RecipeError: missing keys or values of the wrong shape, or a prompt of
                another shape (text, messages) than the file's first; names file, row, key.
        """
        keys = (self.chosen_key, self.rejected_key, self.block)
        if self.fmt == "hh":
            fields = _hh_fields(row, where, *keys)
            if fields is None:
                return None
        else:
            if self.implicit is None:
                self.implicit = self.prompt_key == "auto" and "prompt" not in row
            fields = _pair_fields(row, where, self.implicit, self.prompt_key, *keys)
        margin = _margin(row, self.margin_key, where, self.block)
        pair = PreferencePair(n, *fields, margin, hh=self.fmt == "hh")
        if self.first is not None:
            _check_same_shape(pair, self.first, where)
        self.first = self.first or pair
        return pair

    @classmethod
    def of(cls, block: FileData, key: str, margin_key: str | None = None) -> PairRows:
        """The reader of a file block's pairs (its format and keys)."""
        keys = (block.prompt_key, block.chosen_key, block.rejected_key)
        return cls(block.format, *keys, margin_key, key)

    def empty(self, path: str | Path, skipped: int) -> RecipeError:
        """The error for a file with no usable pair, with the count of hh rows skipped."""
        why = (
            f"; {skipped} hh rows skipped: no '\\n\\nAssistant:' turn shared by chosen and rejected"
            if skipped
            else ""
        )
        return RecipeError(f"{path}: no usable preference pairs{why}")


def load_pairs(
    path: str | Path,
    fmt: str,
    prompt_key: str = "auto",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    limit: int | None = None,
    margin_key: str | None = None,
    split: str | None = None,
    block: str = "data.train",
) -> tuple[list[PreferencePair], int]:
    """Pairs of a data file or folder (`PairRows` over `rows.read_items`, first `limit`)
    and how many rows were skipped (hh rows that do not split).

    Raises:
        RecipeError: unreadable rows, missing keys or values of the wrong shape, rows
            that mix text and message prompts, or no usable pair; names file, row, key.
    """
    reader = PairRows(fmt, prompt_key, chosen_key, rejected_key, margin_key, block)
    return read_items(path, split, block, reader, limit)


class HhPromptRows(PairRows):
    """The row reader of the prompts of an hh file (GRPO / PPO): its pairs, read as
    `load_pairs` reads them (the block's `limit` counts pairs), then their single-turn
    prompts (`pair_prompts`) with the block's `data_source`."""

    def __init__(self, block: FileData, key: str):
        super().__init__("hh", "auto", block.chosen_key, block.rejected_key, None, key)
        self.path = block.path
        self.meta = {} if block.data_source is None else {"data_source": block.data_source}

    def finish(self, items: list[Any]) -> list[Any]:
        """Raises RecipeError: no pair is single-turn (`pair_prompts`)."""
        prompts = pair_prompts(items, self.block)
        return [
            replace(p, metadata=dict(self.meta), origin=f"{self.path} pair {p.prompt_id}")
            for p in prompts
        ]


def _pair_fields(
    row: dict,
    where: str,
    implicit: bool,
    prompt_key: str,
    chosen_key: str,
    rejected_key: str,
    block: str,
) -> tuple[str | list[Message], str, str]:
    """A 'pairs' row's fields: the implicit prompt (the shared start of chosen and
    rejected) when `implicit`, else the prompt under `prompt_key` ('auto': 'prompt')."""
    key = "prompt" if prompt_key == "auto" else prompt_key
    return (
        implicit_fields(row, where, chosen_key, rejected_key, block)
        if implicit
        else _row_fields(row, where, key, chosen_key, rejected_key, block)
    )


def _check_same_shape(pair: PreferencePair, first: PreferencePair, where: str) -> None:
    """Raises RecipeError when `pair`'s prompt is text and the file's `first` one
    messages, or the other way round."""
    if pair.is_chat != first.is_chat:
        shape = "messages" if first.is_chat else "text"
        raise RecipeError(
            f"{where}: the prompt changes shape; earlier rows give "
            f"the prompt as {shape}: use one shape for the whole file"
        )


def _margin(row: dict, key: str | None, where: str, block: str) -> float:
    if key is None:
        return 0.0
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
        _bad_key(row, key, where, "a number >= 0 (reward_model.margin_key)", block)
    return float(v)


def pair_prompts(pairs: list[PreferencePair], block: str = "data.train") -> list[PromptItem]:
    """The prompts of hh pairs for GRPO / PPO: each pair whose dialogue is one `Human:`
    turn gives its text as a prompt; no ground truth. (Prompts of other preference
    files are read row by row, recipes/data/layouts.py.)

    Raises:
        RecipeError: no pair is single-turn.
    """
    out = []
    for p in pairs:
        messages = hh_messages(p.prompt) if isinstance(p.prompt, str) else p.prompt
        if len(messages) == 1 and messages[0]["role"] == "user" and messages[0]["content"]:
            out.append(PromptItem(p.pair_id, messages[0]["content"], ""))
    if not out:
        raise RecipeError(
            f"{block}: none of the {len(pairs)} hh pairs has a single-turn "
            f"prompt (one '\\n\\nHuman:' turn); give more rows ({block}.limit), or "
            "the dialogues as chat messages (TRL's conversational chosen / rejected) to "
            "use multi-turn prompts"
        )
    return out


def as_chat(pairs: list[PreferencePair], fmt: str | None = None) -> list[PreferencePair]:
    """Text pairs as chat-format pairs: an hh prompt (`p.hh`, or every pair when `fmt`
    is 'hh') split into its turns (replies stripped), any other text prompt as one user
    message; chat pairs unchanged.

    Raises:
        RecipeError: an hh prompt with no `Human:` turn.
    """
    out = []
    for p in pairs:
        if p.is_chat:
            out.append(p)
        elif p.hh or fmt == "hh":
            messages = hh_messages(p.prompt)
            if not messages or messages[-1]["role"] != "user":
                raise RecipeError(
                    f"data.train pair {p.pair_id}: the hh prompt has no "
                    "'\\n\\nHuman:' turn before its last '\\n\\nAssistant:'"
                )
            out.append(
                replace(p, prompt=messages, chosen=p.chosen.strip(), rejected=p.rejected.strip())
            )
        else:
            out.append(replace(p, prompt=[{"role": "user", "content": p.prompt}]))
    return out


def hh_messages(prompt: str) -> list[Message]:
    """An HH-RLHF prompt (`\\n\\nHuman: …\\n\\nAssistant: …\\n\\nHuman: …\\n\\nAssistant:`)
    as chat messages (`user` / `assistant`, text stripped), the final empty assistant
    turn left out. Text before the first turn marker is dropped."""
    parts = _HH_TURN.split(prompt)
    roles = {"Human": "user", "Assistant": "assistant"}
    out = [
        {"role": roles[who], "content": text.strip()}
        for who, text in zip(parts[1::2], parts[2::2], strict=True)
    ]
    if out and out[-1]["role"] == "assistant" and not out[-1]["content"]:
        out.pop()
    return out
