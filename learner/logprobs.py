"""Per-token logprobs of padded sequences under a causal LM, without full-vocabulary
float32 logits.

A step's logits are `[tokens, vocab]`: for SmolLM2 (vocabulary 49,152) one micro-batch
of 16 × 300 tokens is 0.47 GB in bf16 and 0.94 GB again in float32, plus the
log-softmax's and its gradient's copies. Here the LM head runs on chunks of
`chunk_tokens` hidden states at a time (`ChunkedTokenLogprobs`): each chunk's logits
are made, reduced to the sampled token's logit and the log-sum-exp, and dropped; the
backward pass makes them again, chunk by chunk. Same arithmetic per token as
`algorithms.common.token_logprobs` on the model's logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from posttrain.algorithms.common import token_logprobs

#: Hidden states per LM-head chunk: 512 × 49,152 float32 logits = 100 MB at a time.
CHUNK_TOKENS = 512


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(h·Wᵀ / τ)[y] per token, computed `chunk` rows at a time.

    Forward per chunk: `z = F.linear(h, W)` in the compute dtype (as the LM head does),
    cast to float32, divided by τ; returns `z[y] − logsumexp(z)` and keeps only the
    log-sum-exp (`[N]`) for backward. Backward per chunk rebuilds z and uses
    ∂ log p_y / ∂z_j = (1[j = y] − softmax(z)_j) / τ; the chunk's gradient logits are
    cast to the compute dtype (as autograd's backward of `.float()` does) before the
    matmuls, and ∂W is summed over chunks in float32.

    Args (forward):
        hidden: `[..., H]` final hidden states (compute dtype), e.g. `[B, T, H]`.
        weight: `[V, H]` LM head weight (same dtype).
        targets: `[...]` token ids, e.g. `[B, T]`.
        temperature: τ > 0.
        chunk: hidden states per chunk (≥ 1), counted over the flattened `[...]`.

    Returns:
        `[...]` float32 logprobs (a tensor of its own, not a view).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        flat_y = targets.reshape(-1)
        n = flat_h.shape[0]
        # Allocated in the targets' shape (not a view): FSDP2 hooks the root's output.
        result = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        out = result.view(-1)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            z = F.linear(flat_h[s:s + chunk], weight).float()
            if temperature != 1.0:  # in place: no second [chunk, V] buffer
                z.div_(temperature)
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            out[s:s + chunk] = z.gather(-1, flat_y[s:s + chunk, None]).squeeze(-1)
        out -= lse
        ctx.save_for_backward(flat_h, weight, flat_y, lse)
        ctx.temperature, ctx.chunk, ctx.hidden_shape = temperature, chunk, hidden.shape
        return result

    @staticmethod
    def backward(ctx, grad_result):
        hidden, weight, targets, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad_out = grad_result.reshape(-1)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_w else None
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s:s + chunk], grad_out[s:s + chunk, None]
            z = F.linear(h, weight).float()
            if tau != 1.0:
                z.div_(tau)
            # -g·softmax(z)/τ everywhere, +g/τ at the target: in place on z's buffer.
            dz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(-g / tau)
            dz.scatter_add_(-1, targets[s:s + chunk, None], g / tau)
            dz = dz.to(hidden.dtype)
            if want_h:
                grad_h[s:s + chunk] = dz @ weight
            if want_w:
                grad_w += (dz.t() @ h).float()
        return (grad_h.view(ctx.hidden_shape) if want_h else None,
                grad_w.to(weight.dtype) if want_w else None, None, None, None)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           temperature: float = 1.0, chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """`token_logprobs(F.linear(hidden, weight), targets, temperature)` without the
    `[..., V]` logits: see `ChunkedTokenLogprobs`.

    Args:
        hidden: `[B, T, H]` hidden states.
        weight: `[V, H]` LM head weight.
        targets: `[B, T]` token ids.

    Returns:
        `[B, T]` float32 logprobs (differentiable w.r.t. hidden and weight).
    """
    return ChunkedTokenLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk))


def _plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head when it is a bias-free `nn.Linear` whose logits go out as
    they are (no soft-capping); None otherwise (e.g. a LoRA-wrapped head)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    config = getattr(model, "config", None)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    return head


@contextmanager
def _head_returns_logprobs(head: torch.nn.Linear, targets: torch.Tensor, temperature: float,
                           chunk: int) -> Iterator[None]:
    """Make `head` return the targets' logprobs instead of logits for one forward: it
    still runs inside the model's forward, so FSDP2 has its weight unsharded (and
    reduces its gradient) exactly as for the plain head."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        # hidden [B, keep, H]: position t predicts the target in column t + 1.
        return chunked_token_logprobs(hidden[:, :-1], head.weight, targets, temperature, chunk)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = CHUNK_TOKENS,
) -> torch.Tensor:
    """Logprob of each token given the tokens before it, for columns from
    `response_start` on; 0 on earlier columns.

    Position ids are counted over real tokens only (cumsum of the mask), so left
    padding shifts nothing, whatever the pad id. The LM head runs only on the response
    columns (`logits_to_keep`), and (`chunk_tokens` set, plain linear head) on
    `chunk_tokens` hidden states at a time, never holding `[B, T, V]` logits.

    Args:
        model: a transformers causal LM (plain, peft- or FSDP-wrapped).
        input_ids: `[B, T]` token ids.
        attention_mask: `[B, T]` 1 on real tokens.
        response_start: first column whose logprob is wanted (≥ 1).
        temperature: logits are divided by it, as at sampling time.
        chunk_tokens: hidden states per LM-head chunk; None: full logits (the
            reference path, also taken for heads that are not a plain linear layer).

    Returns:
        `[B, T]` float32 logprobs.

    Raises:
        ValueError: `response_start` outside [1, T), or `chunk_tokens` < 1.
    """
    width_total = input_ids.shape[1]
    if not 1 <= response_start < width_total:
        raise ValueError(f"response_start {response_start} outside [1, {width_total})")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be ≥ 1 (or None)")
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    keep = width_total - response_start + 1
    targets = input_ids[:, response_start:]
    head = _plain_head(model) if chunk_tokens is not None else None
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                  logits_to_keep=keep, use_cache=False)
    if head is not None:
        with _head_returns_logprobs(head, targets, temperature, chunk_tokens):
            out[:, response_start:] = model(**kwargs).logits
        return out
    logits = model(**kwargs).logits[:, :-1]
    out[:, response_start:] = token_logprobs(logits, targets, temperature)
    return out
