"""Preference pairs for DPO and reward models: loading (any file kind recipes/rows.py
reads) and tokenisation into paired rows.

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

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..common.chat_tokens import adds_bos as _adds_bos
from ..common.chat_tokens import chat_turns as _chat_turns
from ..common.chat_tokens import hh_messages
from ..common.chat_tokens import one_bos as _one_bos
from ..common.chat_tokens import stop_ids as _stop_ids
from ..config import RecipeError
from .items import PromptItem, check_messages
from .rows import read_rows

HH_MARK = "\n\nAssistant:"
#: Template ids (part of the DPO reference-logprob cache key): how prompts were built.
PLAIN_TEMPLATE_ID = "plain-text-v1"  # raw text, replies + EOS, no BOS
PLAIN_BOS_TEMPLATE_ID = "plain-text-bos-v1"  # the same with the tokenizer's BOS in front
CHAT_TEMPLATE_ID = "chat-template-v1"  # the model's chat template, one BOS at most

Message = dict[str, str]


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


def _shared_start(a: Any, b: Any) -> int:
    """How many leading items (characters or messages) `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


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
    n = _shared_start(c, r)
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
    """Pairs of a data file or folder and how many rows were skipped (hh rows that do
    not split). `fmt`: 'auto' / 'pairs' (TRL's layouts; `prompt_key` 'auto': 'prompt'
    when row 1 has it, else the implicit prompt) or 'hh'. `margin_key`: each row's key
    holding a number ≥ 0, the pair's `margin`. `block`: the data block's key path
    (`data.train`, `data.heldout`, `eval.prompts`, a mixture entry), named in errors.

    Raises:
        RecipeError: unreadable rows, missing keys or values of the wrong shape, rows
            that mix text and message prompts, or no usable pair; names file, row, key.
    """
    pairs, skipped, implicit = [], 0, None
    for where, row in read_rows(path, split, block):
        if not isinstance(row, dict):
            raise RecipeError(f"{where}: a row must be a JSON object")
        if fmt == "hh":
            fields = _hh_fields(row, where, chosen_key, rejected_key, block)
            if fields is None:
                skipped += 1
                continue
        else:
            if implicit is None:
                implicit = prompt_key == "auto" and "prompt" not in row
            fields = _pair_fields(row, where, implicit, prompt_key, chosen_key, rejected_key, block)
        margin = _margin(row, margin_key, where, block)
        pair = PreferencePair(len(pairs), *fields, margin, hh=fmt == "hh")
        if pairs:
            _check_same_shape(pair, pairs[0], where)
        pairs.append(pair)
        if limit and len(pairs) >= limit:
            break
    if not pairs:
        raise _no_pairs_error(path, skipped)
    return pairs, skipped


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


def _no_pairs_error(path: str | Path, skipped: int) -> RecipeError:
    """The error for a file with no usable pair, with the count of hh rows skipped."""
    why = (
        f"; {skipped} hh rows skipped: no '\\n\\nAssistant:' turn shared by chosen and rejected"
        if skipped
        else ""
    )
    return RecipeError(f"{path}: no usable preference pairs{why}")


def _margin(row: dict, key: str | None, where: str, block: str) -> float:
    if key is None:
        return 0.0
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
        _bad_key(row, key, where, "a number >= 0 (reward_model.margin_key)", block)
    return float(v)


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


def pair_prompts(pairs: list[PreferencePair], block: str = "data.train") -> list[PromptItem]:
    """The prompts of hh pairs for GRPO / PPO: each pair whose dialogue is one `Human:`
    turn gives its text as a prompt; no ground truth. (Prompts of other preference
    files are read row by row, recipes/layouts.py.)

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
