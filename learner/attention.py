"""Causal attention for the learner's packed rows: attention within each packed example
(`segment_sdpa`, a transformers attention function), and on CPU torch's flash kernel
forward with a backward in a few batched matmuls (`causal_attention`).

torch's CPU flash-attention backward walks each (row, head) in blocks; at the lengths a
packed SFT or RL batch holds (runs of about 100-300 tokens) it ran 2.8x its forward on
machine H. With the forward's log-sum-exp kept, the backward is five batched matmuls
over the whole `[L, L]` score matrix of each head group, which ran 0.56x the flash
backward's time at 18 x 9 heads x 147 tokens (docs/benchmarks.md). The score matrices
are held in float32 for the duration of one layer's backward, so the matmul backward is
taken only while they fit `MATMUL_BACKWARD_BYTES`; elsewhere, and on CUDA, it is
`F.scaled_dot_product_attention` as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

#: Largest float32 score tensor (`rows × heads × L × L × 4` bytes) the matmul backward
#: materialises; about three such tensors are alive at once during one layer's backward.
MATMUL_BACKWARD_BYTES = 256 * 2**20


class FlashForwardMatmulBackward(torch.autograd.Function):
    """Causal softmax attention with grouped key/value heads (GQA).

    Forward: `aten._scaled_dot_product_flash_attention_for_cpu` (its output is bitwise
    `F.scaled_dot_product_attention`'s on CPU), keeping its log-sum-exp.

    Backward (Dao et al. 2022, "FlashAttention", Algorithm 4, without the tiling), with
    s = scale · q kᵀ and the causal mask:
        P = exp(s − lse),  dV = Pᵀ dO,  dP = dO Vᵀ,  Δ = rowsum(dO ∘ O),
        dS = P ∘ (dP − Δ),  dQ = scale · dS K,  dK = scale · dSᵀ Q.
    P and dS are float32 (float64 for float64 inputs), cast to the inputs' dtype for the
    matmuls.

    Args (of `apply`):
        q: `[N, H, L, D]`; k, v: `[N, H_kv, L, D]` with H a multiple of H_kv (query head
            h uses key/value head h // (H / H_kv), as `enable_gqa` does).
        scale: the scores' factor (1/√D unless the model says otherwise).

    Returns:
        `[N, H, L, D]`.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        n, h, length, d = q.shape
        hk = k.shape[1]
        g = h // hk
        scale = ctx.scale
        acc = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64
        # the g query heads of one key/value head, stacked: [N, H_kv, g·L, D]
        qg = q.reshape(n, hk, g * length, d)
        dog = d_out.reshape(n, hk, g * length, d)
        s = torch.matmul(qg, k.transpose(-1, -2)).to(acc).mul_(scale)
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
        p = s.view(n, hk, g, length, length).sub_(lse.view(n, hk, g, length, 1)).exp_()
        p.masked_fill_(causal, 0.0)
        p_in = p.to(q.dtype).view(n, hk, g * length, length)
        dv = torch.matmul(p_in.transpose(-1, -2), dog)
        del p_in, s
        dp = torch.matmul(dog, v.transpose(-1, -2)).to(acc).view(n, hk, g, length, length)
        delta = (d_out.to(acc) * out.to(acc)).sum(-1).view(n, hk, g, length, 1)
        ds = p.mul_(dp.sub_(delta)).mul_(scale).to(q.dtype).view(n, hk, g * length, length)
        del dp, p
        dq = torch.matmul(ds, k).view(n, h, length, d)
        dk = torch.matmul(ds.transpose(-1, -2), qg)
        return dq, dk, dv, None


def matmul_backward_fits(q: torch.Tensor) -> bool:
    """Whether `causal_attention` takes the matmul backward for queries `q [N, H, L, D]`:
    on CPU, with gradients wanted and the float32 scores under `MATMUL_BACKWARD_BYTES`."""
    n, h, length, _ = q.shape
    return (
        q.device.type == "cpu"
        and torch.is_grad_enabled()
        and n * h * length * length * 4 <= MATMUL_BACKWARD_BYTES
    )


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of `q [N, H, L, D]` over `k, v [N, H_kv, L, D]`: the same output
    as `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=H != H_kv)`, with
    `FlashForwardMatmulBackward`'s backward where `matmul_backward_fits` (and no
    dropout), else SDPA's own."""
    if dropout == 0.0 and q.shape[1] % k.shape[1] == 0 and matmul_backward_fits(q):
        return FlashForwardMatmulBackward.apply(
            q, k, v, q.shape[-1] ** -0.5 if scale is None else scale
        )
    return sdpa_causal(q, k, v, scale, dropout)


def sdpa_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`'s causal attention, grouped heads allowed (its own
    backward): `causal_attention`'s fall-back, and bench/learner.py's before of it."""
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


#: The name `segment_sdpa` is registered under in transformers' `AttentionInterface`.
SEGMENT_ATTENTION = "posttrain_segments"


def run_buckets(runs: list[int], ratio: float = 2**0.5) -> list[list[int]]:
    """The runs grouped for padded attention calls: sorted longest first, a bucket keeps
    the runs no shorter than its longest / `ratio`, so padding each to the bucket's
    longest computes at most `ratio`² the score pairs each run needs.

    Returns:
        lists of indices into `runs`, longest bucket first.
    """
    order = sorted(range(len(runs)), key=lambda i: -runs[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and runs[i] * ratio >= runs[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def _bucket_index(runs: list[int], device: torch.device) -> tuple[list, torch.Tensor]:
    """Per bucket (`run_buckets`) the `[n, L]` token index of its runs, padded with each
    run's own last token (computed, never read back), and the `[sum(runs)]` index of
    each token in the buckets' outputs laid end to end."""
    starts = [0]
    for n in runs[:-1]:
        starts.append(starts[-1] + n)
    where = torch.empty(sum(runs), dtype=torch.long)
    index, offset = [], 0
    for bucket in run_buckets(runs):
        width = runs[bucket[0]]
        col = torch.arange(width)
        start = torch.tensor([starts[i] for i in bucket])[:, None]
        size = torch.tensor([runs[i] for i in bucket])[:, None]
        index.append((start + torch.minimum(col, size - 1)).to(device))
        for row, i in enumerate(bucket):
            at = offset + row * width
            where[starts[i] : starts[i] + runs[i]] = torch.arange(at, at + runs[i])
        offset += len(bucket) * width
    return index, where.to(device)


#: The last call's (runs, blocks, plan): every layer of one forward gets the same runs
#: and blocks objects, so the plan (its index and masks) is built once per forward.
_LAST_PLAN: tuple = (None, None, None)


def _segment_plan(runs: list[int], blocks: torch.Tensor | None, device: torch.device) -> tuple:
    """`([(index or None, (n, L), mask or None) per bucket], where or None)` for
    `segment_sdpa`: None in place of an index that is the identity (one bucket of equal
    runs in order: a view, no gather); the `[n, 1, L, L]` bool mask of `blocks`."""
    global _LAST_PLAN
    last = _LAST_PLAN
    if last[0] is runs and last[1] is blocks:
        return last[2]
    index, where = _bucket_index(runs, device)
    identity = len(index) == 1 and index[0].numel() == sum(runs)
    identity = identity and torch.equal(index[0].view(-1), torch.arange(sum(runs), device=device))
    buckets = []
    for idx in index:
        mask = None
        if blocks is not None:  # a padded column repeats its run's last token: unseen
            blk = blocks.index_select(0, idx.view(-1)).view(idx.shape)
            same = (blk[:, None, :] == 0) | (blk[:, None, :] == blk[:, :, None])
            causal = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool, device=device)
            mask = (same & causal.tril())[:, None]
        buckets.append((None if identity else idx.view(-1), tuple(idx.shape), mask))
    plan = (buckets, None if identity else where)
    _LAST_PLAN = (runs, blocks, plan)
    return plan


def segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    segment_runs: list[int] | None = None,
    segment_blocks: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA within each run of a packed row only: the attention of
    `segment_attention`'s block mask without its masked blocks (a row of k examples of
    length L computes about L²/k score pairs, not L²). The runs are gathered into a few
    padded batches of similar lengths (`run_buckets`), one causal attention call each
    (`learner/attention.py` `causal_attention`; right padding: no real query sees a
    padded key), and gathered back. A transformers
    attention function (`AttentionInterface`); the runs come in as the model call's
    `segment_runs` keyword.

    Args:
        query: `[B, H, T, D]`; key, value: `[B, H_kv, T, D]` (H a multiple of H_kv).
        attention_mask: must be None (the runs are the mask).
        segment_runs: `segment_runs(segment_ids)`.
        segment_blocks: None, or `[B·T]` long for runs that are GRPO groups
            (`packing.PackedGroups`): 0 on a prompt token, k on the k-th response. A
            token then attends causally to the block-0 tokens and its own block's of its
            run (SDPA under that mask, per bucket).

    Returns:
        (`[B, T, H, D]` attention output, None). A padding run attends causally within
        itself (finite; its positions are never read).

    Raises:
        ValueError: no `segment_runs`, a mask as well, runs not summing to B·T, or a
            layer that asks for a sliding window, logit soft-capping or attention sinks.
    """
    b, h, t, d = query.shape
    if segment_runs is None or attention_mask is not None or sum(segment_runs) != b * t:
        raise ValueError(
            "segment attention needs `segment_runs` summing to the batch's tokens and no mask"
        )
    unknown = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if unknown:  # plain causal SDPA would drop them: a silently different attention
        raise ValueError(
            f"segment attention computes plain causal attention; this layer asks for "
            f"{unknown}: load the model with attn_implementation='eager' for packed rows"
        )
    buckets, where = _segment_plan(segment_runs, segment_blocks, query.device)
    if where is None and b == 1:  # one bucket of the runs in order: [n, heads, L, D] views
        n, width = buckets[0][1]
        q, k, v = (x.reshape(x.shape[1], n, width, d).transpose(0, 1) for x in (query, key, value))
    else:  # token-major [B·T, heads, D]; k and v keep their H_kv heads (SDPA's enable_gqa)
        q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    out = []
    for idx, (n, width), mask in buckets:
        # [n, heads, L, D]; index_select's backward is one index_add
        qs, ks, vs = (
            (x if idx is None else x.index_select(0, idx)).view(n, width, -1, d).transpose(1, 2)
            if q.dim() == 3
            else x
            for x in (q, k, v)
        )
        if mask is None:
            o = causal_attention(qs, ks, vs, scale=scaling, dropout=dropout)
        else:
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
            )
        out.append(o.transpose(1, 2).reshape(n * width, h, d))
    flat = out[0] if len(out) == 1 else torch.cat(out)
    return (flat if where is None else flat.index_select(0, where)).view(b, t, h, d), None


@contextmanager
def segment_attention_on(config) -> Iterator[None]:
    """`segment_sdpa` as the model's attention for the forwards inside (the config's
    `_attn_implementation`, read by each attention layer at each call), then back; it
    needs no mask, so transformers builds none."""
    from transformers import AttentionInterface

    if SEGMENT_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(SEGMENT_ATTENTION, segment_sdpa)
    old = config._attn_implementation
    config._attn_implementation = SEGMENT_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = old
