"""Per-token logprobs of padded sequences under a causal LM."""

from __future__ import annotations

import torch

from posttrain.algorithms.common import token_logprobs


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of each token given the tokens before it, for columns from
    `response_start` on; 0 on earlier columns.

    Position ids are counted over real tokens only (cumsum of the mask), so left
    padding shifts nothing, whatever the pad id. Logits are computed only for the
    response columns (`logits_to_keep`), which skips the LM head on prompt tokens.

    Args:
        model: a transformers causal LM (plain or FSDP-wrapped).
        input_ids: `[B, T]` token ids.
        attention_mask: `[B, T]` 1 on real tokens.
        response_start: first column whose logprob is wanted (≥ 1).
        temperature: logits are divided by it, as at sampling time.

    Returns:
        `[B, T]` float32 logprobs.

    Raises:
        ValueError: `response_start` outside [1, T).
    """
    width_total = input_ids.shape[1]
    if not 1 <= response_start < width_total:
        raise ValueError(f"response_start {response_start} outside [1, {width_total})")
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    keep = width_total - response_start + 1
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        logits_to_keep=keep,
        use_cache=False,
    ).logits[:, :-1]
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    out[:, response_start:] = token_logprobs(logits, input_ids[:, response_start:], temperature)
    return out
