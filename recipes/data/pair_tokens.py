"""Token ids of preference pairs for DPO, reward-model training and `posttrain eval`
(recipes/data/pairs.py loads the pairs).

Tokenisation (`tokenize_pairs_with_template`): chat-format pairs are rendered with
the model's chat template, prompt + reply being the template's rendering of the whole
conversation up to and including the reply's end-of-turn token; the prompt is what the
two renderings share with the generation prompt's (a `<think>` the generation prompt
opens is not doubled, nor given to a reply without one). Text pairs (`hh`, text
`pairs`) stay raw text, with the tokenizer's BOS in front when it adds one to its own
encodings. `tokenize_pairs` is the older plain-text-only tokenisation (no BOS), kept for
existing callers.

One rendering everywhere (`render_pairs`): DPO, reward-model training and `posttrain
eval` turn text pairs into chat pairs first (`as_chat`) when the model has a chat
template and `dpo.chat_template` / `reward_model.chat_template` is on (the default), so
a policy trains on the prompts it is sampled with (rollouts use the chat template) and
a reward model on what the reward service renders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...common.chat_tokens import adds_bos as _adds_bos
from ...common.chat_tokens import chat_turns as _chat_turns
from ...common.chat_tokens import one_bos as _one_bos
from ...common.chat_tokens import stop_ids as _stop_ids
from ...config import RecipeError
from .pairs import PreferencePair, as_chat

#: Template ids (part of the DPO reference-logprob cache key): how prompts were built.
PLAIN_TEMPLATE_ID = "plain-text-v1"  # raw text, replies + EOS, no BOS
PLAIN_BOS_TEMPLATE_ID = "plain-text-bos-v1"  # the same with the tokenizer's BOS in front
CHAT_TEMPLATE_ID = "chat-template-v1"  # the model's chat template, one BOS at most


@dataclass(frozen=True)
class TokenizedPair:
    """Token ids of one pair: `[P]` prompt, `[Rc]` chosen and `[Rr]` rejected replies
    (each reply ending with EOS, or for chat pairs the template's end-of-turn token)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclass(frozen=True)
class PairTokenization:
    """Tokenised pairs and how their prompts were built.

    Attributes:
        pairs: one `TokenizedPair` per kept input pair, in order.
        template_id: `CHAT_TEMPLATE_ID`, `PLAIN_TEMPLATE_ID` or `PLAIN_BOS_TEMPLATE_ID`;
            goes into the DPO reference-logprob cache key.
        description: one line for the run's console (the data summary), with the count
            of dropped pairs.
        kept: the input index of each pair in `pairs`.
        identical: input pairs dropped because their chosen and rejected ids are equal
            after truncation to `max_length` (no preference left: the loss is log 2
            with zero gradient and the accuracy counts a tie).
    """

    pairs: list[TokenizedPair]
    template_id: str
    description: str
    kept: list[int]
    identical: int = 0


def _fit(
    prompt: list[int], replies: list[list[int]], max_length: int, keep_first: int = 0
) -> tuple[list[int], list[list[int]]]:
    """Truncate to `max_length` tokens per row: the end of the prompt (its first
    `keep_first` tokens, a BOS, always kept) and the start of the replies, the prompt
    never shorter than half of `max_length` (TRL's keep_end/keep_start)."""
    longest = max(len(r) for r in replies)
    if len(prompt) + longest <= max_length:
        return prompt, replies
    keep = max(max_length - longest, max_length // 2)
    if keep < len(prompt):
        prompt = prompt[:keep_first] + prompt[len(prompt) - max(keep - keep_first, 0) :]
    return prompt, [r[: max(max_length - len(prompt), 0)] for r in replies]


def tokenize_pairs(
    pairs: list[PreferencePair], tokenizer: Any, max_length: int
) -> list[TokenizedPair]:
    """Plain-text tokenisation (no chat template, no BOS), replies end with EOS. A pair
    longer than `max_length` keeps the end of its prompt and the start of its replies,
    with the prompt never shorter than half of `max_length` (TRL's keep_end/keep_start).
    Kept for existing callers; new code calls `tokenize_pairs_with_template`."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for p in pairs:
        prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        replies = [
            tokenizer(r, add_special_tokens=False)["input_ids"] + eos
            for r in (p.chosen, p.rejected)
        ]
        prompt, replies = _fit(prompt, replies, max_length)
        out.append(TokenizedPair(prompt, replies[0], replies[1]))
    return out


def tokenize_pairs_with_template(
    pairs: list[PreferencePair], tokenizer: Any, max_length: int
) -> PairTokenization:
    """Token ids of every pair, prompts built as rollouts build them.

    Chat-format pairs: prompt + reply is the chat template's rendering of the
    conversation up to and including the reply's end-of-turn token (one BOS where the
    tokenizer uses one, never two); the prompt is the part both renderings share with
    the generation prompt's (`chat_tokens.chat_turns`). Text pairs: raw text without special tokens,
    the tokenizer's BOS in front if it adds one to its encodings, replies + EOS.
    Pairs longer than `max_length` keep the BOS, the end of the prompt and the start
    of the replies (the prompt never shorter than half of `max_length`). A pair whose
    chosen and rejected ids are then equal is dropped and counted (`identical`).

    Args:
        pairs: all chat-format or all text (as `load_pairs` returns them).
        tokenizer: the policy's transformers tokenizer.
        max_length: most tokens of prompt + reply per row.

    Raises:
        RecipeError: chat-format pairs but the tokenizer has no chat template, or every
            pair is identical after truncation.
        ValueError: `pairs` mixes chat-format and text prompts.
    """
    chat = _template_kind(pairs, tokenizer)
    bos, adds_bos = tokenizer.bos_token_id, _adds_bos(tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stops, out = _stop_ids(tokenizer), []
    for p in pairs:
        if chat:
            prompt, replies = _chat_pair_ids(tokenizer, p, bos, adds_bos, stops)
        else:
            prompt = _one_bos(
                tokenizer(p.prompt, add_special_tokens=False)["input_ids"], bos, adds_bos
            )
            replies = [
                tokenizer(r, add_special_tokens=False)["input_ids"] + eos
                for r in (p.chosen, p.rejected)
            ]
        keep_first = 1 if bos is not None and prompt[:1] == [bos] else 0
        prompt, replies = _fit(prompt, replies, max_length, keep_first)
        out.append(TokenizedPair(prompt, replies[0], replies[1]))
    template, text = _template_id(chat, bos, adds_bos)
    return _without_identical(out, template, f"DPO prompts: {text}", max_length)


def _template_kind(pairs: list[PreferencePair], tokenizer: Any) -> bool:
    """Whether the pairs are chat-format (False for no pairs).

    Raises:
        ValueError: `pairs` mixes chat-format and text prompts.
        RecipeError: chat-format pairs but the tokenizer has no chat template.
    """
    chat = bool(pairs) and pairs[0].is_chat
    if any(p.is_chat != chat for p in pairs):
        raise ValueError("pairs mix chat-format and text prompts; tokenise them separately")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"chat-format preference pairs need a chat template, and the "
            f"tokenizer of {tokenizer.name_or_path!r} has none: give the "
            "prompts as text, or use a model that ships a chat template"
        )
    return chat


def _chat_pair_ids(
    tokenizer: Any, p: PreferencePair, bos: int | None, adds_bos: bool, stops: set[int]
) -> tuple[list[int], list[list[int]]]:
    """A chat-format pair's prompt ids and its two replies, before truncation: prompt +
    reply is the chat template's rendering of the whole conversation up to and
    including the reply's end-of-turn token, one BOS at most; the prompt is what the
    renderings share with the generation prompt's (`chat_tokens.chat_turns`)."""
    prompt, replies = _chat_turns(tokenizer, p.prompt, [p.chosen, p.rejected], stops)
    return _one_bos(prompt, bos, adds_bos), replies


def _template_id(chat: bool, bos: int | None, adds_bos: bool) -> tuple[str, str]:
    """The prompts' template id (`PairTokenization.template_id`) and how they were
    built, for the data summary."""
    if chat:
        template = CHAT_TEMPLATE_ID
        text = "the model's chat template (chat-format pairs), replies end at its end of turn"
    else:
        with_bos = adds_bos and bos is not None
        template = PLAIN_BOS_TEMPLATE_ID if with_bos else PLAIN_TEMPLATE_ID
        text = f"plain text, no chat template{' (with BOS)' if with_bos else ''}"
    return template, text


def _without_identical(
    out: list[TokenizedPair], template_id: str, description: str, max_length: int
) -> PairTokenization:
    """The tokenisation without the pairs whose chosen and rejected ids are equal.

    Raises:
        RecipeError: every pair is.
    """
    kept = [i for i, t in enumerate(out) if t.chosen_ids != t.rejected_ids]
    dropped = len(out) - len(kept)
    why = (
        f"chosen and rejected are identical after truncation to max_length {max_length} "
        "(no preference left to learn)"
    )
    if out and not kept:
        raise RecipeError(
            f"all {len(out)} preference pairs dropped: {why}; raise max_length "
            "(dpo.max_length or reward_model.max_length)"
        )
    if dropped:
        description += f"; {dropped} of {len(out)} pairs dropped: {why}"
    return PairTokenization([out[i] for i in kept], template_id, description, kept, dropped)


def render_pairs(
    pairs: list[PreferencePair], tokenizer: Any, max_length: int, chat_template: bool = True
) -> PairTokenization:
    """Token ids of preference pairs, rendered one way for every consumer: DPO, the
    reward model's training and `posttrain eval` (and so as the reward service renders
    what it scores). With `chat_template` and a tokenizer that has one, text pairs are
    turned into chat pairs first (`as_chat`: an hh dialogue into its turns, another text
    prompt into one user message), so every pair is the template's prompt and assistant
    turn; otherwise text pairs stay raw text (see `tokenize_pairs_with_template`).

    Raises:
        RecipeError: as `as_chat` and `tokenize_pairs_with_template`.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        pairs = as_chat(pairs)
    return tokenize_pairs_with_template(pairs, tokenizer, max_length)
