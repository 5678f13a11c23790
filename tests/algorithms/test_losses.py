"""GRPO math on hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.common import aggregate_loss, clipped_policy_loss, kl_k3, loss_denominator
from posttrain.algorithms.grpo import group_advantages


def test_equal_rewards_give_exact_zero_with_and_without_std():
    r = torch.tensor([0.5, 0.5, 0.5, 0.5])
    for scale in (True, False):
        adv = group_advantages(r, ["g"] * 4, scale_by_std=scale)
        assert torch.equal(adv, torch.zeros(4))


def test_near_equal_group_uses_unbiased_std_plus_eps():
    # mean 1.000005, deviations ±5e-6, unbiased std 7.0711e-6; +1e-6 → ±0.6196
    adv = group_advantages(torch.tensor([1.0, 1.00001]), ["g", "g"])
    expected = 5e-6 / (math.sqrt(2 * (5e-6) ** 2) + 1e-6)
    assert adv.tolist() == pytest.approx([-expected, expected], abs=2e-3)
    assert abs(adv[1].item()) == pytest.approx(0.62, abs=5e-3)


def test_groups_are_found_by_id_not_position():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])  # p1, p2, p1, p2 interleaved
    adv = group_advantages(rewards, ["p1", "p2", "p1", "p2"], scale_by_std=False)
    assert adv.tolist() == [0.5, 0.0, -0.5, 0.0]


def test_failed_rewards_are_left_out_of_the_group():
    rewards = torch.tensor([1.0, math.nan, 0.0, 0.0])
    adv = group_advantages(rewards, ["g"] * 4, scale_by_std=False)
    # mean over the three valid rewards is 1/3
    assert adv.tolist() == pytest.approx([2 / 3, 0.0, -1 / 3, -1 / 3], abs=1e-6)
    assert not torch.isnan(adv).any()


def test_single_valid_sample_gets_zero():
    adv = group_advantages(torch.tensor([1.0, math.nan]), ["g", "g"])
    assert adv.tolist() == [0.0, 0.0]


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="len\\(group_ids\\)"):
        group_advantages(torch.zeros(3), ["a", "b"])


def _two_sequences():
    # A: 2 response tokens with per-token loss 1.0; B: 6 tokens with loss 4.0.
    per_token = torch.zeros(2, 8)
    mask = torch.zeros(2, 8)
    per_token[0, :2], mask[0, :2] = 1.0, 1.0
    per_token[1, :6], mask[1, :6] = 4.0, 1.0
    return per_token, mask


@pytest.mark.parametrize("micro", [1, 2])
def test_token_mean_does_not_depend_on_micro_batch_size(micro):
    per_token, mask = _two_sequences()
    denom = loss_denominator(mask, "token_mean")
    total = sum(
        aggregate_loss(per_token[i : i + micro], mask[i : i + micro], denom).item()
        for i in range(0, 2, micro)
    )
    assert total == pytest.approx(3.25, abs=1e-7)  # (2·1 + 6·4) / 8


def test_seq_mean_token_sum():
    per_token, mask = _two_sequences()
    denom = loss_denominator(mask, "seq_mean_token_sum")
    assert aggregate_loss(per_token, mask, denom).item() == pytest.approx((2 + 24) / 2)


def test_truncated_only_batch_is_finite_and_counts_all_tokens():
    # Responses cut at max_new_tokens still count every token, top and bottom.
    per_token = torch.full((2, 4), 2.0)
    mask = torch.ones(2, 4)
    denom = loss_denominator(mask, "token_mean")
    assert denom == 8
    loss = aggregate_loss(per_token, mask, denom)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(2.0)


def test_all_masked_step_gives_zero_not_nan():
    mask = torch.zeros(2, 4)
    loss = aggregate_loss(torch.ones(2, 4), mask, loss_denominator(mask, "token_mean"))
    assert loss.item() == 0.0


def test_clipped_loss_hand_values():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([1.0])
    t = clipped_policy_loss(new, old, adv, clip_low=0.2, clip_high=0.2)
    # A>0: min(r, clip(r)) → 1.2 (clipped), 0.5 (unclipped: min picks 0.5), 1.1
    assert t.loss.tolist()[0] == pytest.approx([-1.2, -0.5, -1.1], abs=1e-6)
    assert t.clipped.tolist()[0] == [1.0, 0.0, 0.0]
    neg = clipped_policy_loss(new, old, -adv, clip_low=0.2, clip_high=0.2)
    # A<0: -min(-r, -clip(r)) = max(r, clip(r)) → 1.5, 0.8 (clipped), 1.1
    assert neg.loss.tolist()[0] == pytest.approx([1.5, 0.8, 1.1], abs=1e-6)
    assert neg.clipped.tolist()[0] == [0.0, 1.0, 0.0]


def test_policy_gradient_moves_toward_positive_advantage():
    logits = torch.zeros(1, 1, 3, requires_grad=True)
    logp = logits.log_softmax(-1)[..., 0]  # token 0 sampled
    t = clipped_policy_loss(logp, logp.detach(), torch.tensor([1.0]), 0.2, 0.2)
    t.loss.sum().backward()
    assert logits.grad[0, 0, 0] < 0  # descending the loss raises token 0's logit


def test_k3_kl_hand_value_and_zero_at_equality():
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    d = -0.5
    assert kl_k3(lp, ref).item() == pytest.approx(math.exp(d) - d - 1, abs=1e-7)
    assert kl_k3(lp, lp).item() == 0.0


def test_token_entropy_hand_values():
    from posttrain.algorithms.common import token_entropy

    # p = [1/4, 3/4]: −(¼ ln ¼ + ¾ ln ¾) = 0.562335; uniform over 2: ln 2
    logits = torch.tensor([[0.0, math.log(3.0)], [1.5, 1.5]])
    assert token_entropy(logits).tolist() == pytest.approx([0.562335, math.log(2)], abs=1e-6)
    # temperature 2 halves the logits: p = [1, √3] / (1 + √3)
    p = torch.tensor([1.0, math.sqrt(3.0)]) / (1 + math.sqrt(3.0))
    want = float(-(p * p.log()).sum())
    assert token_entropy(logits[:1], 2.0).item() == pytest.approx(want, abs=1e-6)
    assert not token_entropy(logits.requires_grad_(True)).requires_grad
