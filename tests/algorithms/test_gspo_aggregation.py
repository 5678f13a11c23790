"""GSPO averages over sequences (Zheng et al. 2025, eq. 5: (1/G) Σ_i min(s_i·A_i, ...)),
not over tokens: a long sequence weighs as much as a short one, whatever `grpo.loss_agg`
and however the step's rows are split into micro-batches or ranks."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.common import loss_denominator
from posttrain.algorithms.grpo import GRPOLoss, loss, loss_aggregation

S1 = math.exp(0.2)  # sequence 1: log-ratios [0.3, 0.1] → s1 = e^0.2 = 1.221403


def _hand_case() -> tuple[torch.Tensor, TrainBatch]:
    """Two sequences, A = [+1, −1]: sequence 1 has 2 response tokens (log-ratios 0.3,
    0.1) padded to 6 columns whose 4 masked slots carry log-ratio 0.5; sequence 2 has 6
    tokens of log-ratio 0."""
    mask = torch.tensor([[1.0, 1, 0, 0, 0, 0], [1.0, 1, 1, 1, 1, 1]])
    old = torch.full((2, 6), -1.0)
    ratio = torch.tensor([[0.3, 0.1, 0.5, 0.5, 0.5, 0.5], [0.0] * 6])
    logprobs = old + ratio
    adv = torch.tensor([[1.0], [-1.0]]) * mask
    ids = torch.zeros(2, 6, dtype=torch.long)
    agg = loss_aggregation("gspo", "token_mean")
    mb = TrainBatch(
        ids,
        torch.ones_like(ids),
        mask,
        0,
        old_logprobs=old,
        advantages=adv,
        loss_denominator=loss_denominator(mask, agg),
    )
    return logprobs, mb


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_sum"])
def test_gspo_hand_case_is_the_sequence_mean(loss_agg):
    logprobs, mb = _hand_case()
    agg = loss_aggregation("gspo", loss_agg)
    assert agg == "seq_mean_token_mean"
    assert loss_denominator(mb.response_mask, agg) == 2.0
    x = logprobs.clone().requires_grad_(True)
    cfg = GRPOLoss(clip_low=0.3, clip_high=0.3, kind="gspo", loss_agg=loss_agg)
    assert cfg.aggregation == "seq_mean_token_mean"
    out = loss(x, mb, cfg)
    # (−s1·(+1) − s2·(−1)) / 2 = (−1.221403 + 1) / 2
    assert out.loss.item() == pytest.approx(-0.110701, abs=1e-6)
    assert out.loss.item() == pytest.approx((-S1 + 1.0) / 2, abs=1e-6)
    out.loss.backward()
    # sequence 1: −A·s1/(|y1|·2) = −0.305351 per token; sequence 2: s2/(6·2) = +0.083333
    want = torch.tensor([[-S1 / 4, -S1 / 4, 0, 0, 0, 0], [1 / 12] * 6])
    torch.testing.assert_close(x.grad, want, rtol=0, atol=1e-6)
    assert x.grad[0, 0].item() == pytest.approx(-0.305351, abs=1e-6)
    assert x.grad[1, 0].item() == pytest.approx(0.083333, abs=1e-6)


def test_other_losses_keep_the_recipes_aggregation():
    assert loss_aggregation("ppo_clip", "seq_mean_token_sum") == "seq_mean_token_sum"
    assert loss_aggregation("cispo", "token_mean") == "token_mean"


def test_gspo_is_invariant_to_micro_batch_and_rank_split():
    # 6 rows of varied length; the step loss and gradient are the same summed over any
    # split of the rows (each part divides by the step-wide denominator)
    g = torch.Generator().manual_seed(3)
    lengths = [1, 5, 2, 7, 3, 6]
    mask = torch.zeros(6, 8)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    old = -torch.rand(6, 8, generator=g)
    lp = old + 0.2 * torch.randn(6, 8, generator=g)
    adv = torch.randn(6, 1, generator=g) * mask
    agg = loss_aggregation("gspo", "token_mean")
    denom = loss_denominator(mask, agg)
    assert denom == 6.0
    cfg = GRPOLoss(kind="gspo", loss_agg=agg)

    def step(parts: list[list[int]]) -> tuple[float, torch.Tensor]:
        x = lp.clone().requires_grad_(True)
        total = 0.0
        for rows in parts:
            r = torch.tensor(rows)
            ids = torch.zeros(len(rows), 8, dtype=torch.long)
            mb = TrainBatch(
                ids,
                torch.ones_like(ids),
                mask[r],
                0,
                old_logprobs=old[r],
                advantages=adv[r],
                loss_denominator=denom,
            )
            out = loss(x[r], mb, cfg)
            out.loss.backward()
            total += out.loss.item()
        return total, x.grad

    whole, g_whole = step([[0, 1, 2, 3, 4, 5]])
    for parts in ([[0], [1], [2], [3], [4], [5]], [[3, 1], [5, 0, 2], [4]], [[5, 4, 3, 2, 1, 0]]):
        total, grad = step(parts)
        assert total == pytest.approx(whole, abs=1e-6)
        torch.testing.assert_close(grad, g_whole, rtol=0, atol=1e-7)
    # the sequence mean by hand: each sequence's loss −min(s·A, clip(s)·A), mean over 6
    log_ratio = ((lp - old) * mask).sum(-1) / mask.sum(-1)
    s, a = torch.exp(log_ratio), adv[:, 0]
    per_seq = -torch.minimum(s * a, s.clamp(0.8, 1.2) * a)
    assert whole == pytest.approx(float(per_seq.mean()), abs=1e-6)
