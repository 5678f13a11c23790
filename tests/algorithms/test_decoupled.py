"""Decoupled PPO (AReaL, Fu et al. 2025, eq. 5; `train.correction.mode: decoupled`) on
hand-computed tensors, its invariances (padding, micro-batch split) and the per-token
behaviour logprobs of a partial rollout reaching its weights."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.actors.rollout import Rollout
from posttrain.algorithms import grpo, ppo
from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.correction import Correction, correction_terms, decoupled_factor
from posttrain.recipes.algo.rollouts import rollout_batch

DECOUPLED = Correction("decoupled", "token", 2.0)


def _batch(old, inf, adv, mask=None, denominator=None):
    b, t = inf.shape
    mask = torch.ones(b, t) if mask is None else mask
    return TrainBatch(
        input_ids=torch.zeros(b, t, dtype=torch.long),
        attention_mask=torch.ones(b, t),
        response_mask=mask,
        response_start=0,
        old_logprobs=old,
        inference_logprobs=inf,
        advantages=adv,
        loss_denominator=float(mask.sum()) if denominator is None else denominator,
    )


def _hand_case():
    """π_prox = [0.5, 0.4, 0.2], w = π_prox/π_behav = [0.8, 1.5, 2.5], π_θ = [0.7, 0.4,
    0.1] (u = π_θ/π_prox = [1.4, 1.0, 0.5]), A = [+1, −1, −1], ε = 0.2, C = 2."""
    prox = torch.log(torch.tensor([[0.5, 0.4, 0.2]]))
    behav = prox - torch.log(torch.tensor([[0.8, 1.5, 2.5]]))
    theta = torch.log(torch.tensor([[0.7, 0.4, 0.1]])).requires_grad_(True)
    return prox, behav, theta, torch.tensor([[1.0, -1.0, -1.0]])


def test_the_weight_is_untruncated_and_masked_above_the_cap():
    w = torch.tensor([0.25, 1.0, 2.0, 2.01, 9.0])
    assert decoupled_factor(w, 2.0).tolist() == [0.25, 1.0, 2.0, 0.0, 0.0]
    prox, behav, _, _ = _hand_case()
    t = correction_terms(prox, behav, torch.ones(1, 3), DECOUPLED)
    assert t.factor.tolist()[0] == pytest.approx([0.8, 1.5, 0.0], abs=1e-6)
    assert t.weight.tolist()[0] == pytest.approx([0.8, 1.5, 2.5], abs=1e-6)
    assert t.corrected.tolist() == [[0.0, 0.0, 1.0]]


def test_grpo_hand_values_with_the_clip_around_the_proximal_policy():
    """token 0: u 1.4 clipped to 1.2, −1.2·0.8 = −0.96 (no gradient: clipped);
    token 1: A −1, u 1: +1·1.5 = 1.5 (gradient 1.5·u = 1.5 on logprob, over 3 tokens);
    token 2: w 2.5 > C: out (TIS would have kept it at 2·0.8 = 1.6).
    Loss (−0.96 + 1.5) / 3 = 0.18."""
    prox, behav, theta, adv = _hand_case()
    out = grpo.loss(theta, _batch(prox, behav, adv), grpo.GRPOLoss(correction=DECOUPLED))
    assert out.loss.item() == pytest.approx(0.18, abs=1e-6)
    out.loss.backward()
    assert theta.grad.tolist()[0] == pytest.approx([0.0, 0.5, 0.0], abs=1e-6)
    assert out.sums["is_corrected"] == 1.0
    assert out.sums["is_weight"] == pytest.approx(4.8, abs=1e-5)
    assert out.sums["clipped"] == 2.0  # tokens 0 and 2 took the clipped branch
    m = grpo.finish_metrics(out.sums)
    assert m["is_weight_mean"] == pytest.approx(1.6, abs=1e-6)
    assert m["is_corrected_fraction"] == pytest.approx(1 / 3)
    tis = Correction("tis", "token", 2.0)
    other = grpo.loss(theta.detach(), _batch(prox, behav, adv), grpo.GRPOLoss(correction=tis))
    assert other.loss.item() == pytest.approx((0.54 + 1.6) / 3, abs=1e-6)


def test_one_update_per_step_takes_the_proximal_policy_from_the_forward():
    """Fused old logprobs (one update per step): π_prox = π_θ, u = 1, loss −A·w."""
    _, behav, theta, adv = _hand_case()
    mb = _batch(None, behav, adv)
    mb.old_logprobs = None  # the learner's single-update path
    out = grpo.loss(theta, mb, grpo.GRPOLoss(correction=DECOUPLED))
    # w = π_θ/π_behav = [0.7/0.625, 0.4/(0.4/1.5), 0.1/0.08] = [1.12, 1.5, 1.25]
    assert out.loss.item() == pytest.approx((-1.12 + 1.5 + 1.25) / 3, abs=1e-6)


def test_ppo_policy_term_equals_grpo_decoupled():
    prox, behav, theta, adv = _hand_case()
    mb = _batch(prox, behav, adv)
    mb.values, mb.returns = torch.zeros(1, 3), torch.zeros(1, 3)
    out = ppo.loss(theta, mb, ppo.PPOLoss(correction=DECOUPLED), torch.zeros(1, 3))
    assert out.sums["loss"] == pytest.approx(0.18, abs=1e-6)
    assert ppo.finish_metrics(out.sums)["is_corrected_fraction"] == pytest.approx(1 / 3)


def test_sequence_level_is_refused():
    prox, behav, _, _ = _hand_case()
    with pytest.raises(ValueError, match="level must be 'token'"):
        correction_terms(prox, behav, torch.ones(1, 3), Correction("decoupled", "sequence"))


def _random_case(seed: int, rows: int = 4, cols: int = 6):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(rows, cols, generator=g) * 3
    behav = prox + (torch.rand(rows, cols, generator=g) - 0.5) * 2  # w in [e^-1, e]
    theta = prox + (torch.rand(rows, cols, generator=g) - 0.5) * 0.6
    adv = torch.randn(rows, generator=g).unsqueeze(-1).expand(rows, cols).clone()
    mask = (torch.rand(rows, cols, generator=g) > 0.2).float()
    return prox, behav, theta, adv, mask


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_micro_batch_size_does_not_change_the_loss_or_gradient(agg):
    prox, behav, theta0, adv, mask = _random_case(0)
    cfg = grpo.GRPOLoss(correction=DECOUPLED, loss_agg=agg)
    from posttrain.algorithms.common import loss_denominator

    denom = loss_denominator(mask, agg)
    whole = theta0.clone().requires_grad_(True)
    total = grpo.loss(whole, _batch(prox, behav, adv, mask, denom), cfg).loss
    total.backward()
    split = theta0.clone().requires_grad_(True)
    parts = 0.0
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        mb = _batch(prox[rows], behav[rows], adv[rows], mask[rows], denom)
        part = grpo.loss(split[rows], mb, cfg).loss
        part.backward()
        parts += part.item()
    assert parts == pytest.approx(total.item(), abs=1e-6)
    assert torch.allclose(split.grad, whole.grad, atol=1e-7)


def test_padding_does_not_change_the_loss():
    """Extra columns and a padded row, off the mask, with logprobs whose weight would be
    e^20 and an advantage of 100 there: the loss and the real tokens' gradients stay."""
    prox, behav, theta0, adv, mask = _random_case(1)
    cfg = grpo.GRPOLoss(correction=DECOUPLED)
    theta = theta0.clone().requires_grad_(True)
    base = grpo.loss(theta, _batch(prox, behav, adv, mask), cfg).loss
    base.backward()

    def pad(x, value):
        x = torch.cat([x, torch.full((x.shape[0], 3), value)], 1)
        return torch.cat([x, torch.full((1, x.shape[1]), value)], 0)

    padded = pad(theta0, 0.0).requires_grad_(True)
    mb = _batch(pad(prox, 0.0), pad(behav, -20.0), pad(adv, 100.0), pad(mask, 0.0))
    assert mb.loss_denominator == float(mask.sum())
    out = grpo.loss(padded, mb, cfg).loss
    out.backward()
    assert out.item() == pytest.approx(base.item(), abs=1e-7)
    assert torch.equal(padded.grad[:4, :6], theta.grad)
    assert float(padded.grad[4:].abs().sum() + padded.grad[:, 6:].abs().sum()) == 0.0


def test_each_token_of_a_partial_rollout_is_weighed_by_its_own_version():
    """A sample continued across a push: tokens 0-1 sampled by version 3, token 2 by
    version 4, each with its own engine logprob; the batch carries them per column and
    the weight of token t is π_prox(t)/π_{v_t}(t)."""
    r = Rollout(
        uid="u-0",
        group_id="u",
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9],
        inference_logprobs=[-1.0, -2.0, -0.5],
        finish_reason="stop",
        policy_version=3,
        prompt_text="",
        response_text="",
        policy_versions=[3, 3, 4],
    )
    batch = rollout_batch([r], [1.0], pad_id=0)
    cols = slice(batch.response_start, batch.response_start + 3)
    assert batch.inference_logprobs[0, cols].tolist() == [-1.0, -2.0, -0.5]
    prox = torch.zeros_like(batch.inference_logprobs)
    prox[0, cols] = torch.tensor([-1.5, -1.5, -1.5])
    t = correction_terms(prox, batch.inference_logprobs, batch.response_mask, DECOUPLED)
    want = [math.exp(-0.5), math.exp(0.5), math.exp(-1.0)]
    assert t.factor[0, cols].tolist() == pytest.approx(want, abs=1e-6)
    assert float(t.factor.sum()) == pytest.approx(sum(want), abs=1e-6)  # prompt columns 0
