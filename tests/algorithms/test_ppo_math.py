"""PPO math on hand-computed values."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.ppo import (
    PPOLoss,
    advantages_and_returns,
    clipped_value_loss,
    explained_variance,
    gae,
    masked_whiten,
    token_rewards,
)
from posttrain.algorithms.ppo import (
    loss as ppo_loss,
)
from posttrain.learner.models import critic_values


def test_gae_hand_computed_four_tokens():
    # reward 1 on the last of 4 tokens, values [0.5, 0.6, 0.7, 0.8], γ = 1, λ = 0.95,
    # value after EOS = 0:
    #   δ3 = 1 + 0 − 0.8 = 0.2          A3 = 0.2
    #   δ2 = 0 + 0.8 − 0.7 = 0.1        A2 = 0.1 + 0.95·0.2    = 0.29
    #   δ1 = 0 + 0.7 − 0.6 = 0.1        A1 = 0.1 + 0.95·0.29   = 0.3755
    #   δ0 = 0 + 0.6 − 0.5 = 0.1        A0 = 0.1 + 0.95·0.3755 = 0.456725
    # returns = A + V = [0.956725, 0.9755, 0.99, 1.0]
    mask = torch.ones(1, 4)
    rewards = token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    adv, ret = gae(rewards, torch.tensor([[0.5, 0.6, 0.7, 0.8]]), mask, gamma=1.0, lam=0.95)
    assert adv[0].tolist() == pytest.approx([0.456725, 0.3755, 0.29, 0.2], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.956725, 0.9755, 0.99, 1.0], abs=1e-6)


def test_padding_after_eos_changes_nothing():
    values = torch.tensor([[0.5, 0.6, 0.7, 0.8]])
    mask = torch.ones(1, 4)
    a, r = gae(token_rewards(torch.tensor([1.0]), mask), values, mask, lam=0.9)
    padded_v = torch.cat([values, torch.tensor([[9.0, -3.0]])], dim=1)
    padded_m = torch.cat([mask, torch.zeros(1, 2)], dim=1)
    pa, pr = gae(token_rewards(torch.tensor([1.0]), padded_m), padded_v, padded_m, lam=0.9)
    torch.testing.assert_close(pa[:, :4], a, rtol=0, atol=1e-7)
    assert pa[:, 4:].abs().sum() == 0 and pr[:, 4:].abs().sum() == 0


def test_truncated_response_bootstraps_from_given_value():
    mask, values = torch.ones(1, 2), torch.tensor([[0.0, 0.0]])
    adv, _ = gae(torch.zeros(1, 2), values, mask, gamma=1.0, lam=1.0, bootstrap=torch.tensor([0.5]))
    assert adv[0].tolist() == pytest.approx([0.5, 0.5])


def test_k1_penalty_on_every_token_score_on_last():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    r = token_rewards(
        torch.tensor([2.0]),
        mask,
        torch.tensor([[0.0, -1.0, -2.0, 0.0]]),
        torch.tensor([[0.0, -1.5, -1.0, 0.0]]),
        kl_coef=0.1,
    )
    assert r.tolist()[0] == pytest.approx([0.0, -0.05, 0.1 + 2.0, 0.0])


def test_whiten_and_value_clip_and_explained_variance():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = masked_whiten(x, mask)
    assert w[0, :3].tolist() == pytest.approx([-1.224744, 0.0, 1.224744], abs=1e-5)
    assert w[0, 3] == 0
    loss, clipped = clipped_value_loss(
        torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1.0]), clip=0.2
    )
    # unclipped error 0, clipped value 0.2 → error 0.64; the max takes 0.5·0.64
    assert loss.item() == pytest.approx(0.32) and clipped.item() == 1.0
    ret = torch.tensor([[1.0, 2.0, 3.0]])
    assert explained_variance(ret, ret, torch.ones(1, 3)) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 3), 2.0), ret, torch.ones(1, 3)) == pytest.approx(0.0)


def test_truncated_response_bootstraps_from_the_value_after_its_last_token():
    # γ = λ = 1, no whitening, one truncated 3-token response scored 0: A_k = V(s_3) − V(s_k).
    v = [-0.19701, 0.16409, -0.03801, 0.12440]  # V(s_0..s_3); V(s_3) is after the last token
    mask = torch.ones(1, 3)
    batch = TrainBatch(
        torch.zeros(1, 3, dtype=torch.long),
        torch.ones(1, 3, dtype=torch.long),
        mask,
        0,
        values=torch.tensor([v[:3]]),
        old_logprobs=torch.zeros(1, 3),
    )
    raw, adv, ret = advantages_and_returns(
        batch,
        torch.tensor([0.0]),
        torch.tensor([True]),
        torch.tensor([v[3]]),
        gamma=1.0,
        lam=1.0,
        whiten=False,
        bootstrap_truncated=True,
    )
    assert raw[0].tolist() == pytest.approx([0.32141, -0.03969, 0.16241], abs=1e-6)
    assert torch.equal(adv, raw)
    assert ret[0].tolist() == pytest.approx([v[3]] * 3, abs=1e-6)
    # a response that ended with EOS bootstraps from 0, whatever the critic says after it
    eos, _, _ = advantages_and_returns(
        batch,
        torch.tensor([0.0]),
        torch.tensor([False]),
        torch.tensor([v[3]]),
        gamma=1.0,
        lam=1.0,
        whiten=False,
        bootstrap_truncated=True,
    )
    assert eos[0].tolist() == pytest.approx([0.19701, -0.16409, 0.03801], abs=1e-6)


def test_critic_values_read_before_each_token_and_after_the_last():
    class Stub(torch.nn.Module):  # value at position p = 10·p, so the reads are visible
        def forward(self, input_ids, attention_mask, position_ids):
            out = (10.0 * torch.arange(input_ids.shape[1])).expand(input_ids.shape)
            return type("Out", (), {"logits": out[..., None].float()})

    ids = torch.ones(2, 5, dtype=torch.long)
    attn = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])  # left pad; right pad
    mask = torch.tensor([[0.0, 0, 1, 1, 1], [0, 0, 1, 1, 0]])
    values, final = critic_values(Stub(), TrainBatch(ids, attn, mask, 2))
    assert values[0].tolist() == [0.0, 0.0, 10.0, 20.0, 30.0]  # V(s_t) read at t − 1
    assert final.tolist() == [40.0, 30.0]  # V(s_T) at each row's last real token


def test_environment_tokens_in_an_episode_carry_no_advantage_return_or_value_loss():
    # An episode row: 2 model tokens, 2 environment tokens (mask 0), 1 model token;
    # score 1 on the last model token; the critic's values on environment tokens are
    # garbage (9.0) and must not matter. γ = 1, λ = 0.5, by hand over model tokens only:
    #   A4 = 1 + 0 − 0.8 = 0.2
    #   A1 = (0 + 0.8 − 0.6) + 0.5·0.2 = 0.3   (the next model token's value: V4)
    #   A0 = (0 + 0.6 − 0.5) + 0.5·0.3 = 0.25
    # returns = A + V = [0.75, 0.9, ·, ·, 1.0]; 0 on the environment tokens.
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.8]])
    batch = TrainBatch(
        torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long), mask, 0,
        values=values, old_logprobs=torch.zeros(1, 5),
    )  # fmt: skip
    raw, _, ret = advantages_and_returns(
        batch, torch.tensor([1.0]), torch.tensor([False]), torch.tensor([0.0]),
        gamma=1.0, lam=0.5, whiten=False,
    )  # fmt: skip
    assert raw[0].tolist() == pytest.approx([0.25, 0.3, 0.0, 0.0, 0.2], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.75, 0.9, 0.0, 0.0, 1.0], abs=1e-6)
    # the environment tokens' critic values change neither the loss nor its gradient
    batch.advantages, batch.returns, batch.loss_denominator = raw, ret, 3.0
    logprobs = torch.zeros(1, 5, requires_grad=True)
    cfg = PPOLoss(cliprange_value=10.0)
    base = ppo_loss(logprobs, batch, cfg, values.clone().requires_grad_(True))
    moved = values.clone()
    moved[0, 2:4] = -50.0
    v = moved.requires_grad_(True)
    out = ppo_loss(logprobs, batch, cfg, v)
    # ½·mean over the 3 model tokens of (V − R)²: (0.25² + 0.3² + 0.2²) / 2 / 3
    assert out.sums["value_loss"] == pytest.approx(0.0320833, abs=1e-6)
    assert out.sums["value_loss"] == pytest.approx(base.sums["value_loss"], abs=1e-7)
    assert out.sums["tokens"] == 3.0
    out.loss.backward()
    assert v.grad[0, 2:4].abs().sum() == 0 and v.grad[0, [0, 1, 4]].abs().sum() > 0
