"""Conversations for supervised fine-tuning (`algorithm: sft`): the row reader that makes
them (`ChatRows`) and their tokenisation with the mask of their assistant tokens.

Sources: any file or folder recipes/data/rows.py reads (jsonl, json, parquet, csv, a
`save_to_disk` folder, parquet shards) whose rows hold a `messages` list of `{role,
content}` (TRL's conversational layout; roles system, user, assistant, tool), and the
generator `tool_chats` (recipes/data/generators.py).

The assistant mask comes from the chat template:
- a template with `{% generation %}` markers (TRL's assistant-only loss needs them): the
  tokenizer's `return_assistant_tokens_mask`;
- otherwise, for every assistant message i: the tokens of the rendering of messages[:i+1]
  after the part it shares with the rendering of messages[:i] with its generation prompt
  (the reply and the template's end of turn), checked to be a prefix of the whole
  conversation's rendering.
A template for which neither holds cannot mark assistant tokens and is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...common.chat_tokens import shared_start
from ...common.model_folder import load_tokenizer
from ...common.model_registry import readable_model_folder
from ...config import RecipeError
from .items import Message, check_messages
from .rows import RowReader

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


class ChatRows(RowReader):
    """The row reader of SFT conversations (`rows.read_items`): each row's `messages`
    (a list, or in a csv column its JSON text), checked (`items.check_messages`: at least
    one assistant turn), as a `ChatExample`."""

    def __init__(self, key: str = "data.train"):
        self.key = key

    def __call__(self, row: dict[str, Any], where: str, n: int) -> ChatExample:
        """Row `where` as conversation number `n`.

        Raises:
            RecipeError: no `messages`, or messages `check_messages` refuses; names the
                file, the row and the key.
        """
        if "messages" not in row:
            raise RecipeError(
                f"{where}: no key 'messages' (row keys: {sorted(row)}); SFT rows hold "
                "messages: [{role, content}, ...]"
            )
        value = row["messages"]
        if isinstance(value, str):  # a csv column of JSON
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise RecipeError(f"{where}: key 'messages' is text that is not JSON") from None
        return ChatExample(check_messages(value, where, "messages", False, True), where)


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
        upto = _render(tokenizer, messages[: i + 1], False)
        # The turn starts where it leaves the generation prompt (which may open the reply
        # with text the reply brings itself, a `<think>`), never before that prompt.
        opened, prompt_start = 0, 0
        if i:
            gen = _render(tokenizer, messages[:i], True)
            opened = shared_start([gen, upto])
            prompt_start = shared_start([gen, _render(tokenizer, messages[:i], False)])
        before = upto[:opened]
        if opened < prompt_start or full[: len(upto)] != upto or len(upto) <= len(before):
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
    folder = readable_model_folder(recipe.model.path, convert)
    if folder is None:
        return False
    tokenize_chats(load_tokenizer(folder), examples, recipe.sft.max_length)
    return True
