"""Where a scalar-head (sequence-classification, one label) model is read: the one
function the learner (training a reward model, `learner.models.reward_scores`) and the
reward service (`rewards.reward_model`) both call, so a reward model is served exactly
as it was trained.

The score is the head's output at each row's last token the attention mask marks: the
reply's closing end-of-turn or EOS token. Transformers' own pooling reads the last token
that is not `config.pad_token_id` instead, which with pad = eos (SmolLM2: both 2) is the
token *before* the closing EOS, and with a right-padded row of pad = eos cannot tell the
EOS from the padding at all.

A saved reward model must also pool there under plain transformers
(`AutoModelForSequenceClassification`): its config gets `pooling_pad_id`, a pad id that
is never a row's last token (not an EOS id), so "the last token that is not the pad id"
is the closing EOS of an unpadded or left-padded row, and of a right-padded one when it
is padded with that id (the saved tokenizer's pad token, `learner.checkpoint`).

Limits: the head must be a module named `score` (transformers' `*ForSequenceClassification`
of decoder models, peft's `modules_to_save` wrapper of it).
"""

from __future__ import annotations

from typing import Any

import torch

from .chat_tokens import stop_ids


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B]` long: the last column whose mask is 1 in each row (0 for an empty row),
    whatever the padding side. `[B, T]` in."""
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return torch.where(attention_mask > 0, cols, torch.zeros_like(cols)).max(-1).values


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The model's score head: its shallowest submodule named `score` (under peft, the
    `modules_to_save` wrapper the base model calls).

    Raises:
        ValueError: no submodule is named `score`.
    """
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "score":
            return module
    raise ValueError(
        f"{type(model).__name__} has no `score` head; a reward model is an "
        "AutoModelForSequenceClassification with one label"
    )


def sequence_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """`[B]` float32 scores: the score head's output at `last_token_index(attention_mask)`,
    from one forward of `model` (plain, peft- or FSDP-wrapped; gradients flow when
    enabled). Position ids count real tokens only, so left padding shifts nothing.

    Args:
        input_ids, attention_mask: `[B, T]`, padded on either side with any id.
    """
    captured: list[torch.Tensor] = []
    hook = score_head(model).register_forward_hook(lambda _m, _i, out: captured.append(out))
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=False,
        )
    finally:
        hook.remove()
    per_token = captured[-1]  # [B, T, 1]
    rows = torch.arange(per_token.shape[0], device=per_token.device)
    return per_token[rows, last_token_index(attention_mask).to(per_token.device), 0].float()


def pooling_pad_id(tokenizer: Any, pad_id: int | None, eos_ids: Any = None) -> int | None:
    """The `pad_token_id` a reward model's config gets (module docstring): `pad_id` (else
    the tokenizer's pad) unless it is an EOS id; then the first special token id that is
    neither an EOS nor the BOS, so transformers' pooling reads a row's closing EOS.

    Args:
        tokenizer: the model's transformers tokenizer.
        pad_id: the config's `pad_token_id`, or None.
        eos_ids: the config's `eos_token_id` (an id, a list of ids or None), also never a
            pad.

    Returns:
        The pad id, or with no such special token (e.g. GPT-2's one `<|endoftext|>`) the
        pad as given (plain transformers then reads one token early; posttrain does not).
    """
    ends = {tokenizer.eos_token_id}
    ends.update(eos_ids if isinstance(eos_ids, list | tuple) else [eos_ids])
    ends.discard(None)
    pad = pad_id if pad_id is not None else tokenizer.pad_token_id
    if pad is not None and pad not in ends:
        return pad
    others = sorted(stop_ids(tokenizer) - ends - {tokenizer.bos_token_id})
    if others:
        return others[0]
    return pad if pad is not None else tokenizer.eos_token_id
