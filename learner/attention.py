"""Causal attention for the learner's packed rows: on CPU, torch's flash kernel forward
and a backward in a few batched matmuls.

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
