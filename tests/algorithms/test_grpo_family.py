"""The GRPO family (issue 17) on hand-computed tensors: RLOO and REINFORCE++ advantages,
GSPO and CISPO losses, DAPO's truncation mask and soft overlong penalty."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.common import aggregate_loss, clipped_policy_loss, loss_denominator
from posttrain.algorithms.grpo import (
    ESTIMATORS,
    GRPOLoss,
    finish_metrics,
    group_advantages,
    loss,
    mask_truncated,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from posttrain.algorithms.policy_losses import POLICY_LOSSES, cispo, gspo

# --- advantage estimators -------------------------------------------------------------


def test_rloo_hand_values_nan_and_interleaved_groups():
    # g: valid [1, 0, 0.5] → 1 − 0.25, 0 − 0.75, 0.5 − 0.5; h: [0.3, 0.3] → 0; NaN → 0
    r = torch.tensor([1.0, 0.3, 0.0, math.nan, 0.5, 0.3])
    adv = rloo_advantages(r, ["g", "h", "g", "g", "g", "h"])
    assert adv.tolist() == pytest.approx([0.75, 0.0, -0.75, 0.0, 0.0, 0.0], abs=1e-7)
    assert adv.dtype == torch.float32 and not torch.isnan(adv).any()


def test_rloo_pair_and_single_valid_sample():
    assert rloo_advantages(torch.tensor([1.0, 0.0]), ["g", "g"]).tolist() == [1.0, -1.0]
    assert rloo_advantages(torch.tensor([1.0, math.nan]), ["g", "g"]).tolist() == [0.0, 0.0]


def test_reinforce_pp_group_baseline_then_batch_std():
    # centred: g [0.5, -0.5], h [0, 0]; NaN left out; unbiased std of the 4 valid = √(1/6)
    r = torch.tensor([1.0, 0.5, math.nan, 0.0, 0.5])
    adv = reinforce_pp_advantages(r, ["g", "h", "g", "g", "h"], eps=1e-6)
    a = 0.5 / (math.sqrt(0.5 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([a, 0.0, 0.0, -a, 0.0], abs=1e-6)
    assert adv[1].item() == 0.0 and adv[4].item() == 0.0  # exact, not round-off


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("value", [0.1, 1 / 3, 7.3, -2.9])
def test_equal_rewards_give_exact_zero_in_fp32(name, value):
    r = torch.full((5,), value, dtype=torch.float32)
    adv = ESTIMATORS[name](r, ["g"] * 5, True, 1e-6)
    assert torch.equal(adv, torch.zeros(5))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_constant_group_stays_zero_beside_a_group_with_signal(name):
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.25])
    adv = ESTIMATORS[name](r, ["a", "a", "a", "b", "b", "b"], True, 1e-6)
    assert torch.equal(adv[:3], torch.zeros(3)) and adv[3] > 0 > adv[4]


def test_grpo_estimator_is_todays_function():
    assert ESTIMATORS["grpo"] is group_advantages


# --- policy losses ----------------------------------------------------------------------


def _gspo_case():
    # row 0: token ratios [2, 0.5] (+ a masked column) → geometric mean 1;
    # row 1: token ratios [1.5, 1.5, 1.5] → 1.5
    lp = torch.log(torch.tensor([[2.0, 0.5, 10.0], [1.5, 1.5, 1.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return lp, torch.zeros(2, 3), mask


def test_gspo_sequence_ratio_and_per_sequence_clip():
    lp, old, mask = _gspo_case()
    t = gspo(lp, old, torch.tensor([2.0, 1.0]), mask, 0.2, 0.2)
    assert t.ratio[:, 0].tolist() == pytest.approx([1.0, 1.5], abs=1e-6)
    # row 0: −s·A = −2 on each token; row 1: A>0 and s=1.5 → clipped to −1.2
    torch.testing.assert_close(t.loss, torch.tensor([[-2.0] * 3, [-1.2] * 3]), atol=1e-6, rtol=0)
    assert t.clipped.tolist() == [[0.0] * 3, [1.0] * 3]
    neg = gspo(lp, old, torch.tensor([2.0, -1.0]), mask, 0.2, 0.2)
    assert neg.loss[1].tolist() == pytest.approx([1.5] * 3, abs=1e-6)  # max(s, clip(s))
    assert neg.clipped[1].tolist() == [0.0] * 3


def test_gspo_advantages_per_token_and_gradient():
    lp, old, mask = _gspo_case()
    lp = lp.clone().requires_grad_(True)
    adv = torch.tensor([[2.0, 2.0, 0.0], [1.0, 1.0, 1.0]])  # as the batch carries them
    t = gspo(lp, old, adv, mask, 0.2, 0.2)
    aggregate_loss(t.loss, mask, 1.0).backward()
    # row 0 (unclipped, s = 1): d(−2·s·A)/dlp_t = −2·A·s/|y| = −2 on its 2 tokens ;
    # the masked column and the clipped row 1 get no gradient
    torch.testing.assert_close(
        lp.grad, torch.tensor([[-2.0, -2.0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6, rtol=0
    )


def test_cispo_hand_values_and_gradient_kept_through_the_clip():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_(True)
    t = cispo(lp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), 0.2, 0.2)
    w = [1.2, 0.8, 1.1]
    expected = [-wi * math.log(r) for wi, r in zip(w, [1.5, 0.5, 1.1], strict=True)]
    assert t.loss[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert t.clipped[0].tolist() == [1.0, 1.0, 0.0]
    t.loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.2, -0.8, -1.1], abs=1e-6)  # −sg(w)·A


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_at_ratio_one_each_loss_has_ppo_clips_gradient(kind):
    # One update per step: old_logprobs are the forward's own, ratio 1. GSPO's loss is one
    # per sequence, so both are reduced as a mean over each sequence's tokens.
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([0.7, -1.3])

    def grad_of(fn):
        x = logits.clone().requires_grad_(True)
        lp = x.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        terms = fn(lp, lp.detach(), adv, mask, 0.2, 0.28)
        ((terms.loss * mask).sum(-1) / mask.sum(-1)).sum().backward()
        return x.grad

    want = grad_of(POLICY_LOSSES["ppo_clip"])
    torch.testing.assert_close(grad_of(POLICY_LOSSES[kind]), want, rtol=1e-5, atol=1e-7)


def _batch(old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> TrainBatch:
    ids = torch.zeros(mask.shape, dtype=torch.long)
    return TrainBatch(
        ids,
        torch.ones_like(ids),
        mask,
        0,
        old_logprobs=old,
        advantages=adv.unsqueeze(-1) * mask,
        loss_denominator=loss_denominator(mask, "token_mean"),
    )


def test_default_loss_is_ppo_clip_bit_for_bit():
    lp, old, mask = _gspo_case()
    mb = _batch(old, torch.tensor([2.0, -1.0]), mask)
    out = loss(lp, mb, GRPOLoss())
    terms = clipped_policy_loss(lp, old, mb.advantages, 0.2, 0.2)
    assert torch.equal(out.loss, aggregate_loss(terms.loss, mask, mb.loss_denominator))


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_loss_dispatches_by_kind_with_the_same_metric_keys(kind):
    lp, old, mask = _gspo_case()
    mb = _batch(old, torch.tensor([2.0, 1.0]), mask)
    cfg = GRPOLoss(kind=kind)
    mb.loss_denominator = loss_denominator(mask, cfg.aggregation)
    out = loss(lp, mb, cfg)
    assert set(finish_metrics(out.sums)) == {"loss", "clip_fraction", "kl"}
    if kind == "gspo":  # (−2 + −1.2) / 2 sequences; row 1's 3 tokens clipped
        assert out.loss.item() == pytest.approx(-3.2 / 2, abs=1e-6)
        assert finish_metrics(out.sums)["clip_fraction"] == pytest.approx(3 / 5)


# --- DAPO overlong handling ---------------------------------------------------------------


def test_mask_truncated_hand_case_token_mean():
    # A (not truncated): 2 tokens with loss 1.0; B (truncated): 6 tokens with loss 5.0
    per_token, mask = torch.zeros(2, 6), torch.zeros(2, 6)
    per_token[0, :2], mask[0, :2] = 1.0, 1.0
    per_token[1, :6], mask[1, :6] = 5.0, 1.0
    kept = mask_truncated(mask, torch.tensor([False, True]))
    denom = loss_denominator(kept, "token_mean")
    assert denom == 2.0
    assert aggregate_loss(per_token, kept, denom).item() == pytest.approx(1.0, abs=1e-7)
    assert mask.sum() == 8  # the input is not changed


def test_only_truncated_responses_give_zero_not_nan():
    mask = torch.ones(2, 4)
    kept = mask_truncated(mask, torch.tensor([True, True]))
    for agg in ("token_mean", "seq_mean_token_sum"):
        out = aggregate_loss(torch.full((2, 4), 5.0), kept, loss_denominator(kept, agg))
        assert out.item() == 0.0


def test_overlong_penalty_dapo_eq13():
    # L_max 20, L_cache 4: free up to 16, then −(len − 16)/4 · factor, −factor at 20
    lengths = torch.tensor([3, 16, 17, 18, 20])
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == pytest.approx(
        [0.0, 0.0, -0.125, -0.25, -0.5], abs=1e-7
    )
    assert overlong_penalty(torch.tensor([25]), 20, 4).tolist() == [-1.0]
