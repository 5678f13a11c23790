"""Per-token logprobs of padded sequences under a causal LM, without full-vocabulary
float32 logits.

A step's logits are `[tokens, vocab]`: for SmolLM2 (vocabulary 49,152) one micro-batch
of 16 × 300 tokens is 0.47 GB in bf16 and 0.94 GB again in float32, plus the
log-softmax's and its gradient's copies. Here the LM head runs on chunks of
`chunk_tokens` hidden states at a time (`ChunkedTokenLogprobs`): each chunk's logits
are made, reduced to the sampled token's logit and the log-sum-exp (and, asked for, the
distribution's entropy), and dropped; the backward pass makes them again, chunk by
chunk. Same arithmetic per token as `algorithms.common.token_logprobs` (and
`token_entropy`) on the model's logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from ..algorithms.common import token_entropy, token_logprobs
from .attention import segment_attention_on
from .packing import (
    PackedGroups,
    PaddingFree,
    PromptPacking,
    checkpointed,
    packed_prompts,
    segment_attention,
)

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
        entropy: None, or a list the forward appends the `[...]` float32 entropy of
            softmax(z) to (no gradient): lse − Σ_j softmax(z)_j·z_j per chunk, from the
            chunk's logits already made (one more `[chunk, V]` buffer, no extra matmul).

    Returns:
        `[...]` float32 logprobs (a tensor of its own, not a view).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, entropy=None):
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        flat_y = targets.reshape(-1)
        n = flat_h.shape[0]
        # Allocated in the targets' shape (not a view): FSDP2 hooks the root's output.
        result = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        out = result.view(-1)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = (
            torch.empty(n, dtype=torch.float32, device=hidden.device)
            if entropy is not None
            else None
        )
        for s in range(0, n, chunk):
            z = F.linear(flat_h[s : s + chunk], weight).float()
            if temperature != 1.0:  # in place: no second [chunk, V] buffer
                z.div_(temperature)
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk] = z.gather(-1, flat_y[s : s + chunk, None]).squeeze(-1)
            if ent is not None:  # H = lse − Σ p·z, the row dot product as a batched matmul
                p = (z - lse[s : s + chunk, None]).exp_()
                dot = torch.bmm(p.unsqueeze(1), z.unsqueeze(-1)).view(-1)
                ent[s : s + chunk] = lse[s : s + chunk] - dot
        out -= lse
        if ent is not None:
            entropy.append(ent.view(targets.shape))
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
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        )
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s : s + chunk], grad_out[s : s + chunk, None]
            z = F.linear(h, weight).float()
            if tau != 1.0:
                z.div_(tau)
            # -g·softmax(z)/τ everywhere, +g/τ at the target: in place on z's buffer.
            dz = z.sub_(lse[s : s + chunk, None]).exp_().mul_(-g / tau)
            dz.scatter_add_(-1, targets[s : s + chunk, None], g / tau)
            dz = dz.to(hidden.dtype)
            if want_h:
                grad_h[s : s + chunk] = dz @ weight
            if want_w:
                grad_w += (dz.t() @ h).float()
        return (
            grad_h.view(ctx.hidden_shape) if want_h else None,
            grad_w.to(weight.dtype) if want_w else None,
            None,
            None,
            None,
            None,
        )


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = CHUNK_TOKENS,
    entropy: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`token_logprobs(F.linear(hidden, weight), targets, temperature)` without the
    `[..., V]` logits: see `ChunkedTokenLogprobs`.

    Args:
        hidden: `[B, T, H]` hidden states.
        weight: `[V, H]` LM head weight.
        targets: `[B, T]` token ids.
        entropy: a list to append the `[B, T]` entropy (`token_entropy`) to, or None.

    Returns:
        `[B, T]` float32 logprobs (differentiable w.r.t. hidden and weight).
    """
    return ChunkedTokenLogprobs.apply(
        hidden, weight, targets, float(temperature), int(chunk), entropy
    )


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


def _scattered(want: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`[B, R]` float32: `values [n]` (n = want.sum()) at `want`'s True entries in
    row-major order, 0 elsewhere; differentiable w.r.t. `values`."""
    out = torch.zeros(want.shape, dtype=torch.float32, device=values.device)
    return out.masked_scatter(want, values)


@contextmanager
def _head_returns_logprobs(
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    select: tuple[torch.Tensor, torch.Tensor] | None = None,
    entropy: list[torch.Tensor] | None = None,
    want: torch.Tensor | None = None,
) -> Iterator[None]:
    """Make `head` return the targets' logprobs instead of logits for one forward: it
    still runs inside the model's forward, so FSDP2 has its weight unsharded (and
    reduces its gradient) exactly as for the plain head.

    Args:
        targets: `[B, R]` token ids.
        select: `(rows, columns)`, each `[B, R]`: the hidden state that predicts each
            target (a packed forward); None: position t predicts column t + 1.
        entropy: a list to append the targets' `[B, R]` entropies to, or None.
        want: `[B, R]` bool, the targets whose logprob is wanted: the head runs on
            those hidden states only and returns 0 (entropy 0) at the others; None: all.
    """

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if want is None:
            picked = hidden[:, :-1] if select is None else hidden[select[0], select[1]]
            return chunked_token_logprobs(picked, head.weight, targets, temperature, chunk, entropy)
        rows, cols = want.nonzero(as_tuple=True)
        if select is not None:
            rows, cols = select[0][rows, cols], select[1][rows, cols]
        sink: list[torch.Tensor] | None = [] if entropy is not None else None
        lp = chunked_token_logprobs(
            hidden[rows, cols], head.weight, targets[want], temperature, chunk, sink
        )
        if entropy is not None:
            entropy.append(_scattered(want, sink[-1]))
        return _scattered(want, lp)

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
    share_prompts: bool = True,
    segment_ids: torch.Tensor | None = None,
    wanted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logprob of each token given the tokens before it, for columns from
    `response_start` on (and, `wanted` given, only where it is nonzero); 0 elsewhere.

    Position ids are counted over real tokens only (cumsum of the mask), so left
    padding shifts nothing, whatever the pad id. The LM head runs only on the response
    columns (`logits_to_keep`), and (`chunk_tokens` set, plain linear head) on
    `chunk_tokens` hidden states at a time, never holding `[B, T, V]` logits.

    Shared prompts (`share_prompts`; rows with identical prompt columns, as a GRPO
    group's G samples): the rows of one prompt are packed into one sequence, `[prompt |
    response 1 | ... | response G]`, with a mask that lets each response see the prompt
    and itself only and its own position ids, so the prompt is computed once per group
    instead of G times, in one forward (FSDP2's hooks see an ordinary forward). Taken
    with the chunked head and SDPA attention, when it cuts the forward's FLOPs by ≥ 10%
    (`common.packing.packing_pays`) and the responses are right-padded. Only a response's
    real tokens are packed, so its padding columns come back 0. Same values on real
    tokens to float rounding (tests/learner/test_logprobs.py).

    Args:
        model: a transformers causal LM (plain, peft- or FSDP-wrapped).
        input_ids: `[B, T]` token ids.
        attention_mask: `[B, T]` 1 on real tokens.
        response_start: first column whose logprob is wanted (≥ 1).
        temperature: logits are divided by it, as at sampling time.
        chunk_tokens: hidden states per LM-head chunk; None: full logits (the
            reference path, also taken for heads that are not a plain linear layer).
        share_prompts: pack rows that share a prompt (see above).
        segment_ids: `[B, T]` for rows that pack several examples (`TrainBatch.
            segment_ids`): each gets its own position ids and attends to itself only;
            prompt sharing is then off. With SDPA and no checkpointing the rows run as
            one row of their real tokens (`PaddingFree`; padding columns come back 0),
            otherwise under `segment_attention`'s block mask. None: one per row.
        wanted: `[B, T]`, nonzero on the tokens whose logprob is wanted (a loss mask:
            an SFT row's assistant tokens, a response without its padding); the
            chunked head then runs on those positions only, the rest are 0. The
            decoder still runs on every token (they are context). None: all columns
            from `response_start` on.

    Returns:
        `[B, T]` float32 logprobs.

    Raises:
        ValueError: `response_start` outside [1, T), or `chunk_tokens` < 1.
    """
    return sequence_logprobs_and_entropy(
        model,
        input_ids,
        attention_mask,
        response_start,
        temperature,
        chunk_tokens,
        share_prompts,
        entropy=False,
        segment_ids=segment_ids,
        wanted=wanted,
    )[0]


def sequence_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = CHUNK_TOKENS,
    share_prompts: bool = True,
    entropy: bool = True,
    segment_ids: torch.Tensor | None = None,
    wanted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sequence_logprobs` and, from the same forward, the entropy (nats, no gradient)
    of softmax(logits / temperature) (`algorithms.common.token_entropy`): `[B, T]`
    float32, 0 before `response_start`. The chunked head computes it chunk by chunk from
    the logits it makes anyway, a packed forward at each row's own hidden states: it does
    not depend on chunking, packing or which rows share a micro-batch. `entropy=False`:
    None in its place (no cost). Same arguments and errors as `sequence_logprobs`."""
    width_total = input_ids.shape[1]
    if not 1 <= response_start < width_total:
        raise ValueError(f"response_start {response_start} outside [1, {width_total})")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be ≥ 1 (or None)")
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    flat = None
    config = getattr(model, "config", None)
    if segment_ids is not None:
        share_prompts = False
        if _segments_apart(model, config):
            flat = PaddingFree.build(input_ids, segment_ids, response_start)
        else:
            eager = getattr(config, "_attn_implementation", "sdpa") != "sdpa"
            dtype = next(model.parameters()).dtype if eager else None
            positions, attention_mask = segment_attention(segment_ids, dtype)
    keep = width_total - response_start + 1
    targets = input_ids[:, response_start:]
    want = wanted[:, response_start:] != 0 if wanted is not None else None
    head = _plain_head(model) if chunk_tokens is not None else None
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    ent = torch.zeros_like(out) if entropy else None
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        logits_to_keep=keep,
        use_cache=False,
    )
    select = None
    if flat is not None:  # one row of the real tokens; padding columns come back 0
        kwargs, select, want = _packed_call(flat, response_start, want)
    if head is not None and share_prompts:
        pack = packed_prompts(model, input_ids, attention_mask, positions, response_start)
        if pack is not None:
            kwargs, select, want = _packed_call(pack, response_start, want)
            flat = pack if isinstance(pack, PackedGroups) else None
    attention = segment_attention_on(config) if flat is not None else nullcontext()
    if head is not None:
        sink: list[torch.Tensor] | None = [] if entropy else None
        with (
            attention,
            _head_returns_logprobs(head, targets, temperature, chunk_tokens, select, sink, want),
        ):
            out[:, response_start:] = model(**kwargs).logits
        if ent is not None:
            ent[:, response_start:] = sink[-1]
        return out, ent
    with attention:
        logits = model(**kwargs).logits
    logits = logits[flat.rows, flat.columns] if flat is not None else logits[:, :-1]
    out[:, response_start:] = token_logprobs(logits, targets, temperature)
    if ent is not None:
        ent[:, response_start:] = token_entropy(logits, temperature)
    if want is not None:  # as the chunked head: 0 where not wanted
        out[:, response_start:].masked_fill_(~want, 0.0)
        if ent is not None:
            ent[:, response_start:].masked_fill_(~want, 0.0)
    return out, ent


def _packed_call(
    pack: PaddingFree | PackedGroups | PromptPacking,
    response_start: int,
    want: torch.Tensor | None,
) -> tuple[dict, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model call's keywords for a packed forward, the head's `select`, and `want`
    narrowed to real response tokens (padding is not packed: no hidden state predicts
    it)."""
    select = (pack.rows, pack.columns)
    return pack.call(response_start), select, pack.real if want is None else want & pack.real


def _segments_apart(model: torch.nn.Module, config) -> bool:
    """Whether packed examples take `segment_sdpa` (attention per example, no mask):
    with SDPA attention and no gradient checkpointing (its recompute in backward would
    run plain SDPA); otherwise the block mask of `segment_attention`."""
    return getattr(config, "_attn_implementation", None) == "sdpa" and not checkpointed(model)
