"""DPO loss on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms import dpo as dpo_module
from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.dpo import dpo_loss


def _t(*v):
    return torch.tensor(v, dtype=torch.float64)


def test_hand_value_with_precomputed_reference():
    # h = 0.1·((−4 + 5) − (−6 + 5)) = 0.2;  −log σ(0.2) = log(1 + e^−0.2) = 0.598139
    t = dpo_loss(_t(-4.0), _t(-6.0), _t(-5.0), _t(-5.0), beta=0.1)
    assert t.loss.item() == pytest.approx(0.598139, abs=1e-6)
    assert t.chosen_rewards.item() == pytest.approx(0.1)
    assert t.rejected_rewards.item() == pytest.approx(-0.1)


def test_policy_as_its_own_reference_gives_log2():
    # What a run that silently used the policy as reference would see.
    t = dpo_loss(_t(-4.0), _t(-6.0), _t(-4.0), _t(-6.0), beta=0.1)
    assert t.loss.item() == pytest.approx(math.log(2), abs=1e-6)  # 0.693147


def test_label_smoothing_and_ipo():
    h = 0.2
    t = dpo_loss(_t(-4.0), _t(-6.0), _t(-5.0), _t(-5.0), beta=0.1, label_smoothing=0.1)
    want = 0.9 * math.log1p(math.exp(-h)) + 0.1 * math.log1p(math.exp(h))
    assert t.loss.item() == pytest.approx(want, abs=1e-9)
    ipo = dpo_loss(_t(-4.0), _t(-6.0), _t(-5.0), _t(-5.0), beta=0.1, loss_type="ipo")
    assert ipo.loss.item() == pytest.approx((2.0 - 5.0) ** 2, abs=1e-9)  # (h/β − 1/(2β))²


def test_gradient_raises_chosen_lowers_rejected():
    pc, pr = _t(-4.0).requires_grad_(), _t(-6.0).requires_grad_()
    dpo_loss(pc, pr, _t(-5.0), _t(-5.0)).loss.sum().backward()
    assert pc.grad.item() < 0 < pr.grad.item()


def test_shape_and_type_errors():
    with pytest.raises(ValueError, match="one shape"):
        dpo_loss(_t(1.0, 2.0), _t(1.0), _t(1.0), _t(1.0))
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(_t(1.0), _t(1.0), _t(1.0), _t(1.0), loss_type="hinge")


def _ipo_pair_batch() -> tuple[TrainBatch, torch.Tensor]:
    # pair 0: chosen 4 tokens each policy − ref = +0.5, rejected 2 tokens each −0.25
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    ref = torch.tensor([[-1.0, -2, -1, -2], [-1.5, -0.5, 0, 0]])
    pol = (ref + torch.tensor([[0.5] * 4, [-0.25] * 4])) * mask
    b = TrainBatch(
        torch.zeros(2, 4, dtype=torch.long),
        torch.ones(2, 4, dtype=torch.long),
        mask,
        0,
        ref_sums=(ref * mask).sum(-1),
        loss_denominator=1.0,
    )
    return b, pol


def test_ipo_compares_per_token_means_by_default():
    b, pol = _ipo_pair_batch()
    out = dpo_module.loss(pol, b, dpo_module.DPOLoss(beta=0.1, loss_type="ipo"))
    assert out.loss.item() == pytest.approx((0.5 + 0.25 - 1 / 0.2) ** 2, abs=1e-5)  # 18.0625
    summed = dpo_module.loss(
        pol, b, dpo_module.DPOLoss(beta=0.1, loss_type="ipo", ipo_token_mean=False)
    )
    assert summed.loss.item() == pytest.approx((2.0 + 0.5 - 1 / 0.2) ** 2, abs=1e-5)  # 6.25
    sigmoid = dpo_module.loss(pol, b, dpo_module.DPOLoss(beta=0.1))
    assert sigmoid.loss.item() == pytest.approx(math.log1p(math.exp(-0.1 * 2.5)), abs=1e-6)
