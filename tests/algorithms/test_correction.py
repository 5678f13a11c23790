"""Off-policy correction (algorithms/correction.py) on hand-computed tensors, and its
wiring into the GRPO and PPO losses."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from posttrain.algorithms import grpo, ppo
from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.correction import (
    Correction,
    correction_terms,
    log_weights,
    mis_mask,
    mismatch_sums,
    tis_factor,
    truncated_logprobs,
)


def _logs(weights):
    """(old, inference) logprobs whose token weights exp(old − inference) are `weights`."""
    inf = torch.full((1, len(weights)), -1.0)
    return inf + torch.log(torch.tensor([weights])), inf


def test_issue_hand_values_tis_and_mis():
    w = torch.tensor([0.5, 1.0, 3.0])
    assert tis_factor(w, 2.0).tolist() == [0.5, 1.0, 2.0]
    assert mis_mask(w, 2.0).tolist() == [1.0, 1.0, 0.0]
    # MIS keeps [1/C, C] inclusive, and drops the low side too
    assert mis_mask(torch.tensor([0.49, 0.5, 2.0, 2.01]), 2.0).tolist() == [0, 1, 1, 0]


def test_token_terms_from_logprobs():
    old, inf = _logs([0.5, 1.0, 3.0])
    mask = torch.ones(1, 3)
    tis = correction_terms(old, inf, mask, Correction("tis", "token", 2.0))
    assert tis.factor.tolist()[0] == pytest.approx([0.5, 1.0, 2.0], abs=1e-6)
    assert tis.corrected.tolist() == [[0.0, 0.0, 1.0]]
    assert tis.weight.tolist()[0] == pytest.approx([0.5, 1.0, 3.0], abs=1e-6)
    mis = correction_terms(old, inf, mask, Correction("mis", "token", 2.0))
    assert mis.factor.tolist() == [[1.0, 1.0, 0.0]] and mis.corrected.tolist() == [[0, 0, 1]]


def test_sequence_level_uses_the_product_over_the_response():
    # row 0: 0.5·1·3 = 1.5 (kept by MIS, untouched by TIS); row 1: 3·3 = 9 (pad column off)
    old = torch.log(torch.tensor([[0.5, 1.0, 3.0], [3.0, 3.0, 7.0]]))
    inf = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    lw = log_weights(old, inf, mask, "sequence")
    assert torch.exp(lw).tolist()[0] == pytest.approx([1.5] * 3, rel=1e-6)
    assert torch.exp(lw).tolist()[1] == pytest.approx([9.0] * 3, rel=1e-6)
    tis = correction_terms(old, inf, mask, Correction("tis", "sequence", 2.0))
    assert tis.factor.tolist()[0] == pytest.approx([1.5] * 3, rel=1e-6)
    assert tis.factor.tolist()[1] == pytest.approx([2.0, 2.0, 0.0], rel=1e-6)
    mis = correction_terms(old, inf, mask, Correction("mis", "sequence", 2.0))
    assert mis.factor.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert mis.corrected.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


def test_bad_settings_raise():
    old, inf = _logs([1.0])
    with pytest.raises(ValueError, match="cap must be > 1"):
        correction_terms(old, inf, torch.ones(1, 1), Correction("tis", "token", 1.0))
    with pytest.raises(ValueError, match="no terms"):
        correction_terms(old, inf, torch.ones(1, 1), Correction("none"))
    with pytest.raises(ValueError, match="level"):
        log_weights(old, inf, torch.ones(1, 1), "batch")


def test_mismatch_sums_k3_and_abs():
    # d = old − inference = [log 2, 0, −log 2]: k3 = r − 1 − log r = [1 − log 2, 0, log 2 − 0.5]
    old, inf = _logs([2.0, 1.0, 0.5])
    s = mismatch_sums(old, inf, torch.ones(1, 3))
    ln2 = math.log(2.0)
    assert s["mismatch_k3"] == pytest.approx((1 - ln2) + (ln2 - 0.5), abs=1e-6)
    assert s["mismatch_abs"] == pytest.approx(2 * ln2, abs=1e-6)
    assert mismatch_sums(inf, inf, torch.ones(1, 3)) == {"mismatch_k3": 0.0, "mismatch_abs": 0.0}


def test_top_p_hand_case_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    full = truncated_logprobs(logits, torch.tensor([0]))
    assert full.item() == pytest.approx(-0.440190, abs=1e-6)
    nucleus = truncated_logprobs(logits, torch.tensor([0]), top_p=0.8)
    assert nucleus.item() == pytest.approx(math.log(math.e**2 / (math.e**2 + math.e)), abs=1e-6)
    assert nucleus.item() == pytest.approx(-0.313262, abs=1e-6)
    rows = logits.expand(3, 4)
    out = truncated_logprobs(rows, torch.tensor([0, 1, 2]), top_p=0.8)
    assert out[1].item() == pytest.approx(-1.313262, abs=1e-6)
    assert out[2].item() == float("-inf")  # sampled outside the nucleus: impossible
    # top_k 3 keeps [2, 1, 0]; temperature 2 halves the logits first
    k3 = truncated_logprobs(logits, torch.tensor([2]), temperature=2.0, top_k=3)
    z = math.exp(1.0) + math.exp(0.5) + 1.0
    assert k3.item() == pytest.approx(math.log(1.0 / z), abs=1e-6)


def test_top_p_one_equals_the_full_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    full = (logits / 0.7).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(truncated_logprobs(logits, targets, 0.7), full, atol=1e-6)


def _batch(old, inf, adv):
    b, t = old.shape
    return TrainBatch(
        input_ids=torch.zeros(b, t, dtype=torch.long),
        attention_mask=torch.ones(b, t),
        response_mask=torch.ones(b, t),
        response_start=0,
        old_logprobs=old,
        inference_logprobs=inf,
        advantages=adv,
        loss_denominator=float(b * t),
    )


def test_grpo_loss_mode_none_is_unchanged_and_tis_scales_the_policy_term():
    old, inf = _logs([0.5, 1.0, 3.0])
    adv = torch.ones(1, 3)
    mb = _batch(old, inf, adv)
    logprobs = old.clone().requires_grad_(True)
    plain = grpo.loss(logprobs, replace(mb, inference_logprobs=None), grpo.GRPOLoss())
    none = grpo.loss(logprobs, mb, grpo.GRPOLoss())
    assert torch.equal(plain.loss, none.loss)  # bit for bit
    assert none.sums["mismatch_abs"] == pytest.approx(2 * math.log(2) + math.log(1.5), abs=1e-5)
    # ratio 1 at old: per-token loss −A = −1; TIS: −(0.5 + 1 + 2) / 3
    tis = grpo.loss(logprobs, mb, grpo.GRPOLoss(correction=Correction("tis", "token", 2.0)))
    assert tis.loss.item() == pytest.approx(-3.5 / 3, abs=1e-6)
    assert tis.sums["is_corrected"] == 1.0
    assert tis.sums["is_weight"] == pytest.approx(4.5, abs=1e-5)
    metrics = grpo.finish_metrics(tis.sums)
    assert metrics["is_weight_mean"] == pytest.approx(1.5, abs=1e-6)
    assert metrics["is_corrected_fraction"] == pytest.approx(1 / 3)
    mis = grpo.loss(logprobs, mb, grpo.GRPOLoss(correction=Correction("mis", "token", 2.0)))
    assert mis.loss.item() == pytest.approx(-2.0 / 3, abs=1e-6)
    mis.loss.backward()
    assert logprobs.grad[0, 2].item() == 0.0  # the masked token gets no gradient


def test_ppo_loss_mode_none_is_unchanged_and_mis_masks():
    old, inf = _logs([0.5, 1.0, 3.0])
    mb = _batch(old, inf, torch.ones(1, 3))
    mb.values, mb.returns = torch.zeros(1, 3), torch.zeros(1, 3)
    values = torch.zeros(1, 3, requires_grad=True)
    plain = ppo.loss(old.clone(), replace(mb, inference_logprobs=None), ppo.PPOLoss(), values)
    none = ppo.loss(old.clone(), mb, ppo.PPOLoss(), values)
    assert torch.equal(plain.loss, none.loss)
    mis = ppo.loss(old.clone(), mb, ppo.PPOLoss(correction=Correction("mis", "token", 2.0)), values)
    assert mis.sums["loss"] == pytest.approx(-2.0 / 3, abs=1e-6)
    assert ppo.finish_metrics(mis.sums)["is_corrected_fraction"] == pytest.approx(1 / 3)
