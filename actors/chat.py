"""Token ids of chat conversations, extended message by message without re-tokenising
what was sampled: the chat template's delta for new messages (used by multi-turn
episodes and by the OpenAI-compatible endpoint's episode recorder).
"""

from __future__ import annotations

from typing import Any


class TemplateMismatch(ValueError):
    """The chat template renders an earlier conversation differently once a message is
    appended, so environment messages cannot be appended as a token delta."""


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    """Token ids of `messages` under the chat template."""
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def message_delta(
    tokenizer: Any,
    history: list[dict[str, str]],
    new: list[dict[str, str]],
    last_sampled: int,
    end_of_turn: int | None,
) -> list[int]:
    """Ids to append after a model turn so the trajectory continues with `new` and the
    next generation prompt, as the chat template would render it.

    Args:
        history: the conversation so far, ending with the model's turn (its text).
        new: the environment's messages.
        last_sampled: the model turn's last sampled id.
        end_of_turn: the template's end-of-turn id (`end_of_turn_token_id`), or None.

    Returns:
        The closing the template puts after the assistant content that the model did not
        sample, then the rendering of `new` and the generation prompt.

    Raises:
        TemplateMismatch: the rendering of `history` is not a prefix of the rendering of
            `history + new` (names the first differing position).
    """
    base = chat_ids(tokenizer, history, generation_prompt=False)
    full = chat_ids(tokenizer, history + new, generation_prompt=True)
    if full[: len(base)] != base:
        at = next(
            (i for i, (a, b) in enumerate(zip(base, full, strict=False)) if a != b),
            min(len(base), len(full)),
        )
        raise TemplateMismatch(
            f"the chat template renders the conversation differently once {len(new)} "
            f"message(s) with role {new[0]['role'] if new else '?'} are appended (first "
            f"difference at token {at}); it cannot be extended turn by turn. Use a template "
            "that renders earlier turns unchanged (ChatML does)"
        )
    glue: list[int] = []
    if end_of_turn is not None and end_of_turn in base:
        last_eot = len(base) - 1 - base[::-1].index(end_of_turn)
        glue = base[last_eot + 1 :] if last_sampled == end_of_turn else base[last_eot:]
    return glue + full[len(base) :]
