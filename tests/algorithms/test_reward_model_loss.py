"""Bradley-Terry reward-model loss on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms import loss_module
from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.reward_model import RewardModelLoss, bradley_terry


def _t(*v):
    return torch.tensor(v, dtype=torch.float64)


def test_hand_values_loss_and_accuracy():
    # r_c − r_r = 1, −1, 0:  −log σ(1) = 0.313262, −log σ(−1) = 1.313262, −log σ(0) = log 2
    t = bradley_terry(_t(2.0, 0.0, 0.5), _t(1.0, 1.0, 0.5))
    torch.testing.assert_close(t.loss, _t(0.313262, 1.313262, math.log(2)), rtol=0, atol=1e-6)
    assert t.correct.tolist() == [1.0, 0.0, 0.0]  # a tie is not ranked right
    assert t.chosen.tolist() == [2.0, 0.0, 0.5] and t.rejected.tolist() == [1.0, 1.0, 0.5]


def test_margin_scalar_and_per_pair():
    # Llama 2: −log σ(r_c − r_r − m); m = 1 turns a gap of 1 into log 2, accuracy unchanged
    t = bradley_terry(_t(2.0), _t(1.0), 1.0)
    assert t.loss.item() == pytest.approx(math.log(2), abs=1e-9)
    assert t.correct.item() == 1.0
    per_pair = bradley_terry(_t(2.0, 2.0), _t(1.0, 1.0), _t(0.0, 3.0))
    # gap − m = 1, −2: −log σ(1) = 0.313262, −log σ(−2) = 2.126928
    torch.testing.assert_close(per_pair.loss, _t(0.313262, 2.126928), rtol=0, atol=1e-6)


def test_shift_invariance_and_shape_check():
    a = bradley_terry(_t(0.3, -1.2), _t(0.1, 0.4))
    b = bradley_terry(_t(10.3, 8.8), _t(10.1, 10.4))  # both replies + 10 (+ 10 on pair 2)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="one shape"):
        bradley_terry(_t(1.0, 2.0), _t(1.0))


def _batch(valid_pairs: int, pairs: int, margins=None) -> TrainBatch:
    rows = 2 * pairs
    mask = torch.zeros(rows, 4)
    mask[: 2 * valid_pairs, 2:] = 1.0
    return TrainBatch(
        torch.zeros(rows, 4, dtype=torch.long),
        torch.ones(rows, 4),
        mask,
        2,
        margins=margins,
        loss_denominator=float(valid_pairs),
    )


def test_learner_loss_skips_padding_pairs_and_finishes_metrics():
    mod = loss_module("reward_model")
    scores = torch.tensor([2.0, 1.0, 0.0, 1.0, 9.0, -9.0], requires_grad=True)
    out = mod.loss(scores, _batch(2, 3), RewardModelLoss())
    # mean over the 2 real pairs: (0.313262 + 1.313262) / 2; the padding pair counts nowhere
    assert out.loss.item() == pytest.approx((0.313262 + 1.313262) / 2, abs=1e-6)
    out.loss.backward()
    assert scores.grad[4:].abs().sum() == 0
    m = mod.finish_metrics(out.sums)
    assert m["rewards/accuracy"] == 0.5
    assert m["rewards/chosen"] == pytest.approx(1.0) and m["rewards/rejected"] == pytest.approx(1.0)
    assert m["rewards/margin"] == pytest.approx(0.0)


def test_learner_loss_adds_constant_and_row_margins():
    mod = loss_module("reward_model")
    scores = torch.tensor([2.0, 1.0])
    margins = torch.tensor([0.5, 0.5])
    out = mod.loss(scores, _batch(1, 1, margins), RewardModelLoss(margin=0.5))
    assert out.loss.item() == pytest.approx(math.log(2), abs=1e-6)  # gap 1 − 0.5 − 0.5 = 0
    with pytest.raises(ValueError, match="whole"):
        mod.loss(torch.zeros(3), _batch(1, 1), RewardModelLoss())
