"""Conversations for supervised fine-tuning (`algorithm: sft`): read, checked, made in code,
and tokenised with the mask of their assistant tokens.

Sources: any file or folder recipes/rows.py reads (jsonl, json, parquet, csv, a
`save_to_disk` folder, parquet shards) whose rows hold a `messages` list of `{role,
content}` (TRL's conversational layout; roles system, user, assistant, tool), and the
generator `tool_chats`: the arithmetic problems as tool-use conversations in the format
the python tool of `grpo_tool_arith.yaml` parses (recipes/episodes/tools.py).

The assistant mask comes from the chat template:
- a template with `{% generation %}` markers (TRL's assistant-only loss needs them): the
  tokenizer's `return_assistant_tokens_mask`;
- otherwise, for every assistant message i: the tokens the rendering of messages[:i+1]
  adds to the rendering of messages[:i] with its generation prompt (the reply and the
  template's end of turn), checked to be a prefix of the whole conversation's rendering.
A template for which neither holds cannot mark assistant tokens and is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..config import FileData, GeneratorData, MixtureData, RecipeError
from .items import Message, chat_messages
from .rows import read_rows

ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class ChatExample:
    """One conversation to train on.

    Attributes:
        messages: `[{role, content}]`, at least one assistant turn.
        origin: where it came from (`FILE:LINE`, `FILE row N`, `tool_chats #i`), for errors.
    """

    messages: list[Message]
    origin: str


@dataclass(frozen=True)
class TokenizedChat:
    """A rendered conversation.

    Attributes:
        ids: `[L]` token ids of the whole conversation under the chat template.
        mask: `[L]` 1 on assistant tokens (trained on), 0 on the rest.
    """

    ids: list[int]
    mask: list[int]


def check_messages(value: Any, where: str, key: str = "messages") -> list[Message]:
    """A row's `messages`, checked: a list of `{role, content}` with known roles, string
    contents and at least one assistant turn.

    Raises:
        RecipeError: naming `where` (file and row) and the key.
    """
    if not isinstance(value, list) or not value:
        raise RecipeError(f"{where}: key {key!r} must be a non-empty list of {{role, content}}")
    out: list[Message] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RecipeError(
                f"{where}: {key}[{i}] must be {{role, content}} with role one of {list(ROLES)}, "
                f"got {m!r:.80}"
            )
        if not isinstance(m.get("content"), str):
            raise RecipeError(f"{where}: {key}[{i}].content must be text, got {m.get('content')!r}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise RecipeError(
            f"{where}: key {key!r} has no assistant turn, so nothing of it is trained on; "
            "give every row at least one {role: assistant, content: ...} message, or drop "
            "the row"
        )
    return out


def file_chats(cfg: FileData, key: str = "data.train") -> list[ChatExample]:
    """The conversations of a file or folder (`messages` per row; `cfg.limit` rows);
    `key`: the block's key path, named in errors."""
    out = []
    for where, row in read_rows(cfg.path, cfg.split, key):
        if not isinstance(row, dict) or "messages" not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise RecipeError(
                f"{where}: no key 'messages' (row keys: {keys}); SFT rows hold "
                "messages: [{role, content}, ...]"
            )
        value = row["messages"]
        if isinstance(value, str):  # a csv column of JSON
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise RecipeError(f"{where}: key 'messages' is text that is not JSON") from None
        out.append(ChatExample(check_messages(value, where), where))
        if cfg.limit is not None and len(out) == cfg.limit:
            break
    if not out:
        raise RecipeError(f"{cfg.path}: holds no rows")
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
    from .sources import arithmetic

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


def source_chats(block: Any, system_prompt: str | None, key: str = "data.train") -> list[Any]:
    """The conversations of a data block (a file, `tool_chats`, or a mixture of them)."""
    from .sources import mix

    if isinstance(block, MixtureData):
        parts = [
            source_chats(s, system_prompt, f"{key}.mixture.{i}")
            for i, s in enumerate(block.mixture)
        ]
        return mix(parts, [s.weight for s in block.mixture], block.size, block.seed)
    if isinstance(block, GeneratorData):
        return tool_chats(block, system_prompt)
    if not isinstance(block, FileData):
        raise RecipeError(f"{key}: SFT conversations come from files or generator: tool_chats")
    return file_chats(block, key)


def has_generation_markers(tokenizer: Any) -> bool:
    """The chat template marks assistant text with `{% generation %}` (also `{%- generation
    -%}`; the regular expression TRL's `has_generation_markers` uses)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and _GENERATION.search(template) is not None


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def tokenize_chat(tokenizer: Any, messages: list[Message], where: str) -> TokenizedChat:
    """`messages` rendered by the chat template, with the mask of its assistant tokens
    (module docstring).

    Raises:
        RecipeError: the tokenizer has no chat template, or it cannot mark the assistant
            tokens (renders earlier turns differently once later ones follow; names the
            conversation and turn).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            "model.path: the tokenizer has no chat template, so SFT cannot tell assistant "
            "tokens from the rest; use a model folder whose tokenizer_config.json has one"
        )
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        if not any(mask):
            raise RecipeError(
                f"{where}: the chat template's {{% generation %}} markers marked no "
                "assistant token; fix the template"
            )
        return TokenizedChat(ids, mask)
    full = _render(tokenizer, messages, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else []
        upto = _render(tokenizer, messages[: i + 1], False)
        if upto[: len(before)] != before or full[: len(upto)] != upto or len(upto) <= len(before):
            raise RecipeError(
                f"{where}: the chat template cannot mark assistant tokens: rendering "
                f"messages[:{i + 1}] (assistant turn {i}) is not the rendering of the turns "
                "before it plus the reply, within the whole conversation's rendering. Use a "
                "template that renders earlier turns unchanged (ChatML does) or one with "
                "{% generation %} markers"
            )
        mask[len(before) : len(upto)] = [1] * (len(upto) - len(before))
    return TokenizedChat(full, mask)


def tokenize_chats(
    tokenizer: Any, examples: list[ChatExample], max_length: int
) -> list[TokenizedChat]:
    """Every example tokenised (`tokenize_chat`) and cut to `max_length` tokens.

    Raises:
        RecipeError: as `tokenize_chat`; or a conversation with no assistant token within
            its first `max_length` tokens (names it and `sft.max_length`).
    """
    out = []
    for e in examples:
        t = tokenize_chat(tokenizer, e.messages, e.origin)
        t = TokenizedChat(t.ids[:max_length], t.mask[:max_length])
        if not any(t.mask[1:]):
            raise RecipeError(
                f"{e.origin}: no assistant token within the first {max_length} tokens "
                "(sft.max_length); raise sft.max_length or shorten the conversation"
            )
        out.append(t)
    return out


def check_chats(recipe: Any, examples: list[ChatExample], convert: bool = False) -> bool:
    """Before anything starts: every conversation renders with the model's chat template
    and has its assistant tokens marked within `sft.max_length` (`tokenize_chats`).
    False when skipped (a built-in alias not yet converted, without `convert`).

    Raises:
        RecipeError: as `tokenize_chats`.
    """
    from .preflight import _readable_model_folder, _tokenizer  # no torch for tokenizer.json

    folder = _readable_model_folder(recipe.model.path, convert)
    if folder is None:
        return False
    tokenize_chats(_tokenizer(folder), examples, recipe.sft.max_length)
    return True
