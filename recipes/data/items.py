"""The controller's unit of training data, `PromptItem`; how a prompt becomes the chat
messages a rollout samples from (`chat_messages`, the one place that puts
`model.system_prompt` in front); and the one check of chat messages every reader uses
(`check_messages`: prompts, preference pairs, SFT conversations); what makes two prompts
the same (`prompt_identity`), by which held-out prompts leave training (`hold_out`,
`without`)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from ...config import RecipeError

Message = dict[str, Any]

__all__ = [
    "MESSAGE_KEYS",
    "ROLES",
    "Message",
    "PromptItem",
    "chat_messages",
    "check_messages",
    "hold_out",
    "message_extras",
    "prompt_identity",
    "show",
    "without",
]


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the training set.

    Attributes:
        prompt_id: stable id within the data set (position in the loaded list).
        question: the (last) user message sent to the policy, as text.
        ground_truth: reference answer the verifier compares against (text).
        metadata: anything else from the source row, passed to reward services
            (`data_source` among it when the row or its source names one).
        messages: the prompt as chat messages (`[{"role", "content"}]`, checked in
            order, ending with a user or tool turn) when the row gave messages or its
            own system message; None: one user message, `question`.
        origin: where the row came from (`FILE:LINE`, `FILE row N`, `NAME #i`), for
            error messages.
    """

    prompt_id: int
    question: str
    ground_truth: str
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[Message] | None = None
    origin: str = ""


def chat_messages(item: PromptItem, system_prompt: str | None) -> list[Message]:
    """The chat messages rollouts render with the chat template (generation prompt on):
    the item's own messages (else `question` as one user message), with `system_prompt`
    (`model.system_prompt`) in front unless the row brought its own system message."""
    messages = [dict(m) for m in item.messages] if item.messages else []
    if not messages:
        messages = [{"role": "user", "content": item.question}]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def prompt_identity(item: PromptItem) -> str:
    """What makes two prompts the same prompt (its messages before
    `model.system_prompt`), for keeping held-out prompts out of training."""
    return json.dumps(chat_messages(item, None), sort_keys=True)


ROLES = ("system", "user", "assistant", "tool")
# The roles each role may follow (None: first message).
_FOLLOWS = {
    "system": (None,),
    "user": (None, "system", "assistant", "tool"),
    "assistant": ("user", "tool"),
    "tool": ("assistant", "tool"),
}


def show(value: Any, width: int = 40) -> str:
    """A value as JSON, cut to `width` characters, for error messages."""
    return json.dumps(value, default=repr)[:width]


#: Keys of a message besides role and content that chat templates read (Qwen3 and
#: DeepSeek-R1 `reasoning_content`, gpt-oss `thinking`, OpenAI-style tool calls), and
#: the type each must have. They are kept; any other key is refused (a template may read
#: it, a trainer may not: OpenAI's `weight`), a null value counts as absent (parquet
#: structs fill keys a row lacks with null).
MESSAGE_KEYS: dict[str, tuple[type, str]] = {
    "reasoning_content": (str, "text"),
    "thinking": (str, "text"),
    "name": (str, "text"),
    "tool_call_id": (str, "text"),
    "tool_calls": (list, "a list of {type, function} mappings"),
}


def message_extras(m: dict[str, Any], where: str, key: str, j: int) -> dict[str, Any]:
    """The keys of message `m` (number `j`, 1-based, of `key`) besides role and content
    that chat templates read (`MESSAGE_KEYS`), checked; null values left out.

    Raises:
        RecipeError: an unknown key or a value of the wrong type; names `where` (file and
            row), `key`, the message and the key.
    """
    out: dict[str, Any] = {}
    for k, v in m.items():
        if k in ("role", "content") or v is None:
            continue
        if k not in MESSAGE_KEYS:
            raise RecipeError(
                f"{where}: {key!r} message {j} has key {k!r}, which posttrain does not pass "
                f"to the chat template; a message holds role, content and "
                f"{', '.join(MESSAGE_KEYS)}: remove {k!r} or rename it"
            )
        kind, wanted = MESSAGE_KEYS[k]
        bad = not isinstance(v, kind) or (kind is list and not all(isinstance(c, dict) for c in v))
        if bad:
            raise RecipeError(f"{where}: {key!r} message {j} key {k!r} is {show(v)}, not {wanted}")
        out[k] = v
    return out


def check_messages(
    value: Any, where: str, key: str, prompt: bool = True, trained: bool = False
) -> list[Message]:
    """`value` as checked chat messages: each `{"role", "content"}` with the other keys
    chat templates read (`MESSAGE_KEYS`, checked by `message_extras`).

    Order: an optional system message first, then user and assistant turns taking turns
    (tool results after an assistant turn or another tool result). With `prompt` the last
    message is a user or tool turn (the policy answers next) and some user message has
    text; with `trained` (an SFT conversation) some message is an assistant turn.

    Raises:
        RecipeError: not a list of `{role, content}` mappings, an unknown role or key, a
            message out of order, content that is not text, an empty prompt or no
            assistant turn to train on; names `where` (file and row), `key` and the
            message's position (1-based).
    """
    if not isinstance(value, list | tuple):
        raise RecipeError(
            f"{where}: {key!r} is {show(value)}; give text or a list of {{role, content}} messages"
        )
    if not value:
        raise RecipeError(f"{where}: {key!r} is an empty list of messages")
    out = [_message(m, j, out_prev, where, key) for j, m, out_prev in _numbered(value)]
    if prompt and out[-1]["role"] not in ("user", "tool"):
        raise RecipeError(
            f"{where}: {key!r} ends with a{'n' if out[-1]['role'] == 'assistant' else ''} "
            f"{out[-1]['role']} message; the policy answers next, so a prompt ends with a "
            "user (or tool) message"
        )
    if prompt and not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise RecipeError(f"{where}: {key!r} has no user message with text (an empty prompt)")
    if trained and not any(m["role"] == "assistant" for m in out):
        raise RecipeError(
            f"{where}: {key!r} has no assistant turn, so nothing of it is trained on; "
            "give every row at least one {role: assistant, content: ...} message, or drop "
            "the row"
        )
    return out


def _numbered(value: list[Any]) -> Any:
    """`(position from 1, message, role of the message before or None)`."""
    prev = None
    for j, m in enumerate(value, start=1):
        yield j, m, prev
        prev = m.get("role") if isinstance(m, dict) else None


def _message(m: Any, j: int, prev: str | None, where: str, key: str) -> Message:
    """Message `j` of `key`, checked (`check_messages`); `prev`: the role before it."""
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise RecipeError(
            f"{where}: {key!r} message {j} is {show(m)}, not a {{role, content}} mapping"
        )
    role, content = m["role"], m["content"]
    if role not in ROLES:
        raise RecipeError(
            f"{where}: {key!r} message {j} has role {show(role)}; the roles are {', '.join(ROLES)}"
        )
    if not isinstance(content, str):
        raise RecipeError(
            f"{where}: {key!r} message {j} ({role}) has content {show(content)}, not text"
        )
    if prev not in _FOLLOWS[role]:
        raise RecipeError(
            f"{where}: {key!r} message {j} ({role}) follows {prev or 'nothing'}: out of "
            "order; messages are an optional system message, then user and assistant "
            "turns in turn (tool results after the assistant)"
        )
    return {"role": role, "content": content, **message_extras(m, where, key, j)}


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


def without(items: list[Any], held: list[Any], key: str = "eval.prompts") -> list[Any]:
    """`items` (prompts or pairs) less those whose prompt equals a held-out one's (`key`:
    the held-out block's key path).

    Raises:
        RecipeError: none is left to train on.
    """
    if not held:
        return items
    keys = {_identity(h) for h in held}
    kept = [i for i in items if _identity(i) not in keys]
    if not kept:
        what = "an evaluation prompt" if key == "eval.prompts" else f"a {key} item"
        raise RecipeError(
            f"{key}: every prompt of data.train is also {what}, so none is left to train "
            "on; hold out other prompts"
        )
    return kept


def _identity(item: Any) -> str:
    """What makes two prompts (or two pairs' prompts) the same."""
    return prompt_identity(item) if isinstance(item, PromptItem) else json.dumps(item.prompt)
