"""Token ids of a conversation and its next reply, rendered with the model's chat
template: one rendering shared by the preference-pair tokenisation (DPO, reward-model
training; recipes/data/pair_tokens.py, `chat_turns`) and the reward service's `reward_model`
component (rewards/reward_model.py), so a reward model scores what it was trained on.

Prompt: `apply_chat_template(messages, add_generation_prompt=True)` with one BOS
where the tokenizer uses one, never two. Reply: the text the template renders for the
assistant turn after the generation prompt, up to and including its end-of-turn
token.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts its BOS in front of its own encodings."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def one_bos(ids: list[int], bos: int | None, expected: bool) -> list[int]:
    """`ids` with at most one leading BOS, and one when `expected`."""
    if bos is None:
        return ids
    start = 0
    while start + 1 < len(ids) and ids[start] == ids[start + 1] == bos:
        start += 1
    ids = ids[start:]
    return [bos] + ids if expected and ids[:1] != [bos] else ids


def stop_ids(tokenizer: Any) -> set[int]:
    """Ids of special tokens: the first one after a reply ends its turn."""
    ids = set(tokenizer.all_special_ids)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, t in decoder.items() if getattr(t, "special", False))
    return ids


def chat_prompt(tokenizer: Any, messages: list[Message]) -> tuple[list[int], str]:
    """`[P]` ids and the text of `messages` with the generation prompt (one BOS at most,
    one where the tokenizer adds one).

    Raises:
        jinja2.TemplateError, ValueError: the template cannot render `messages`.
    """
    kw = {"add_generation_prompt": True}
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    ids = one_bos(list(enc["input_ids"]), tokenizer.bos_token_id, adds_bos(tokenizer))
    return ids, tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def chat_reply(
    tokenizer: Any, messages: list[Message], prompt_text: str, reply: str, stops: set[int]
) -> list[int]:
    """`[R]` ids of `reply` as the chat template renders the assistant turn after
    `messages`: the text after the generation prompt up to and including the first
    special token after the reply (the end-of-turn token). If the template renders
    no special token there, or renders the turn so that it does not extend the
    generation prompt, the reply's text followed by EOS."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    full = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": reply}], tokenize=False
    )
    suffix = full[len(prompt_text) :] if full.startswith(prompt_text) else None
    # The reply is the last text of its turn: rfind skips template text before it.
    at = -1 if suffix is None else suffix.rfind(reply) if reply else 0
    if at < 0:
        return tokenizer(reply, add_special_tokens=False)["input_ids"] + eos
    end = at + len(reply)
    head = tokenizer(suffix[:end], add_special_tokens=False)["input_ids"]
    tail = tokenizer(suffix[end:], add_special_tokens=False)["input_ids"]
    stop = next((i for i, t in enumerate(tail) if t in stops), None)
    return head + (tail[: stop + 1] if stop is not None else eos)


def shared_start(seqs: list[Any]) -> int:
    """How many leading items (tokens, characters) every sequence of `seqs` shares."""
    n = min(len(x) for x in seqs)
    for k in range(n):
        if any(x[k] != seqs[0][k] for x in seqs[1:]):
            return k
    return n


def chat_turns(
    tokenizer: Any, messages: list[Message], replies: list[str], stops: set[int]
) -> tuple[list[int], list[list[int]]]:
    """`[P]` prompt ids and `[R_k]` ids of each reply such that P + R_k is the chat
    template's rendering of `messages` + the assistant turn `replies[k]` up to and
    including its end-of-turn token (the first special token after the reply; EOS
    appended when there is none), one BOS at most.

    P is the longest token prefix that the generation-prompt rendering and every
    reply's rendering share, so a template whose generation prompt opens the reply (a
    `<think>` it adds) neither doubles it for a reply that brings its own nor gives it
    to a reply that has none.

    Raises:
        jinja2.TemplateError, ValueError: the template cannot render `messages`.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen_ids, gen_text = chat_prompt(tokenizer, messages)
    bos, expected = tokenizer.bos_token_id, adds_bos(tokenizer)
    turns = []
    for reply in replies:
        full = tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": reply}], tokenize=False
        )
        opened = shared_start([gen_text, full])  # where the reply's turn leaves the prompt
        # The reply is the last text of its turn: rfind skips template text before it.
        at = full.rfind(reply) if reply else -1
        end = at + len(reply) if at >= opened else opened
        head = tokenizer(full[:end], add_special_tokens=False)["input_ids"]
        tail = tokenizer(full[end:], add_special_tokens=False)["input_ids"]
        stop = next((i for i, t in enumerate(tail) if t in stops), None)
        turn = head + (tail[: stop + 1] if stop is not None else eos)
        turns.append(one_bos(turn, bos, expected))
    n = shared_start([gen_ids, *turns])
    return turns[0][:n], [t[n:] for t in turns]


def plain_ids(tokenizer: Any, prompt: str, reply: str) -> tuple[list[int], list[int]]:
    """`[P]`, `[R]` ids of raw text without a chat template: the prompt with the
    tokenizer's BOS in front if it adds one to its encodings, the reply + EOS."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = one_bos(
        tokenizer(prompt, add_special_tokens=False)["input_ids"],
        tokenizer.bos_token_id,
        adds_bos(tokenizer),
    )
    return ids, tokenizer(reply, add_special_tokens=False)["input_ids"] + eos
