"""The packed rows' causal attention (learner/attention.py): torch's flash forward, a
matmul backward. Its output is bitwise SDPA's, its gradients are exact in float64
(gradcheck) and within bf16 rounding of SDPA's; where it does not fit it is SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.learner import attention
from posttrain.learner.attention import FlashForwardMatmulBackward, causal_attention


def _qkv(n: int, h: int, hk: int, length: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, heads, length, d, generator=g).to(dtype).requires_grad_(True)
        for heads in (h, hk, hk)
    ]


def _sdpa(q, k, v, scale=None):
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def _reference(q, k, v, scale):
    """Causal softmax attention written out in float64, key/value heads repeated."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, 1) for x in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    length = q.shape[2]
    s = s.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def test_hand_values() -> None:
    # one head, two tokens, D = 1, scale 1: token 0 sees itself; token 1 sees both with
    # weights softmax([q1 k0, q1 k1]) = softmax([2, 4]).
    q = torch.tensor([[[[1.0], [2.0]]]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[[[1.0], [2.0]]]], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([[[[3.0], [5.0]]]], dtype=torch.float64, requires_grad=True)
    out = FlashForwardMatmulBackward.apply(q, k, v, 1.0)
    p1 = torch.tensor([2.0, 4.0], dtype=torch.float64).softmax(0)
    assert out.flatten().tolist() == pytest.approx([3.0, 3 * p1[0].item() + 5 * p1[1].item()])
    out.sum().backward()
    # d out1 / d v = p1; d out0 / d v0 = 1
    assert v.grad.flatten().tolist() == pytest.approx([1 + p1[0].item(), p1[1].item()])
    # d out1 / d q1 = sum_j p_j (v_j - out1) k_j
    o1 = 3 * p1[0] + 5 * p1[1]
    dq1 = p1[0] * (3 - o1) * 1 + p1[1] * (5 - o1) * 2
    assert q.grad.flatten().tolist() == pytest.approx([0.0, dq1.item()])


def test_gradcheck_float64_with_grouped_heads() -> None:
    q, k, v = _qkv(2, 6, 2, 7, 4, torch.float64)
    assert torch.autograd.gradcheck(
        lambda a, b, c: FlashForwardMatmulBackward.apply(a, b, c, 0.37), (q, k, v)
    )


@pytest.mark.parametrize(("h", "hk"), [(9, 3), (4, 4)])
def test_matches_float64_reference_and_sdpa(h: int, hk: int) -> None:
    q, k, v = _qkv(5, h, hk, 37, 64, torch.bfloat16)
    g_out = torch.randn(5, h, 37, 64).to(torch.bfloat16)
    out = causal_attention(q, k, v)
    assert torch.equal(out, _sdpa(q, k, v))  # the forward is SDPA's kernel
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    ref = torch.autograd.grad(_reference(q, k, v, 64**-0.5), (q, k, v), g_out.double())
    sdpa = torch.autograd.grad(_sdpa(q, k, v), (q, k, v), g_out)
    for ours, exact, theirs in zip(grads, ref, sdpa, strict=True):
        scale = exact.abs().max().item()
        # bf16 inputs to the matmuls: a few units of bf16's spacing (2^-8) of the largest
        err_ours = (ours.double() - exact).abs().max().item() / scale
        err_sdpa = (theirs.double() - exact).abs().max().item() / scale
        assert err_ours < 0.02
        assert err_ours <= 2 * err_sdpa + 4e-3


def test_custom_scale_float32() -> None:
    q, k, v = _qkv(3, 2, 1, 11, 8, torch.float32)
    out = causal_attention(q, k, v, scale=0.2)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(_reference(q, k, v, 0.2).sum(), (q, k, v))
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def test_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(2, 4, 2, 9, 8, torch.float32)
    calls = []
    real = FlashForwardMatmulBackward.apply
    monkeypatch.setattr(FlashForwardMatmulBackward, "apply", lambda *a: calls.append(1) or real(*a))
    causal_attention(q, k, v)
    assert calls == [1]
    with torch.no_grad():  # no backward to take: SDPA
        causal_attention(q, k, v)
    causal_attention(q, k, v, dropout=0.1)  # dropout: SDPA's
    monkeypatch.setattr(attention, "MATMUL_BACKWARD_BYTES", 2 * 4 * 9 * 9 * 4 - 1)
    out = causal_attention(q, k, v)  # scores over the budget: SDPA's
    assert calls == [1]
    assert torch.equal(out, _sdpa(q, k, v))
