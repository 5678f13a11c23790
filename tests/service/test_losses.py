"""The served losses on hand-computed tensors (Tinker's sums over tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.service.errors import UserError
from posttrain.service.losses import check_loss, tinker_loss

LN2 = math.log(2.0)


def _run(name: str, lp: list[float], **inputs: list[float]):  # noqa: ANN202
    logprobs = torch.tensor([lp], requires_grad=True)
    t = {k: torch.tensor([v]) for k, v in inputs.items()}
    mask = torch.tensor([[1.0] * (len(lp) - 1) + [0.0]])  # last position is padding
    config = check_loss(name, {}, {"target_tokens", *inputs})
    out = tinker_loss(name, logprobs, t, mask, config)
    out.loss.backward()
    return out, logprobs.grad


def test_cross_entropy_is_the_weighted_sum() -> None:
    out, grad = _run("cross_entropy", [-1.0, -2.0, -9.0], weights=[1.0, 0.5, 1.0])
    assert out.loss.item() == pytest.approx(2.0, abs=1e-6)  # 1·1 + 0.5·2; padding 0
    assert grad.tolist() == [[-1.0, -0.5, 0.0]]


def test_importance_sampling_ratio_times_advantage() -> None:
    # ratio exp(-ln2 - (-2 ln2)) = 2, advantage 3: loss −6; d/dlogp = −ratio·A = −6
    out, grad = _run(
        "importance_sampling", [-LN2, 0.0], logprobs=[-2 * LN2, 0.0], advantages=[3.0, 5.0]
    )
    assert out.loss.item() == pytest.approx(-6.0, abs=1e-5)
    assert grad[0, 0].item() == pytest.approx(-6.0, abs=1e-5) and grad[0, 1].item() == 0.0


def test_ppo_clips_at_the_thresholds() -> None:
    # ratio 2: A=+1 takes the clipped 1.2 (loss −1.2), A=−1 the unclipped −2 (loss 2)
    out, _ = _run(
        "ppo", [-LN2, -LN2, 0.0], logprobs=[-2 * LN2, -2 * LN2, 0.0], advantages=[1.0, -1.0, 0.0]
    )
    assert out.loss.item() == pytest.approx(-1.2 + 2.0, abs=1e-5)


def test_cispo_detached_clipped_weight() -> None:
    # weight clip(2, 0.8, 1.2) = 1.2, detached: loss −1.2·1·ln½ = 1.2 ln2, grad −1.2
    out, grad = _run("cispo", [-LN2, 0.0], logprobs=[-2 * LN2, 0.0], advantages=[1.0, 0.0])
    assert out.loss.item() == pytest.approx(1.2 * LN2, abs=1e-5)
    assert grad[0, 0].item() == pytest.approx(-1.2, abs=1e-5)


def test_unknown_loss_config_and_inputs_name_the_field() -> None:
    with pytest.raises(UserError) as e:
        check_loss("dro", {}, {"target_tokens"})
    assert e.value.field == "loss_fn"
    with pytest.raises(UserError) as e:
        check_loss("ppo", {"clip": 0.1}, {"target_tokens", "logprobs", "advantages"})
    assert e.value.field == "loss_fn_config.clip"
    with pytest.raises(UserError) as e:
        check_loss("importance_sampling", {}, {"target_tokens", "logprobs"})
    assert e.value.field == "loss_fn_inputs.advantages"


def test_gspo_ratio_covers_only_the_sampled_tokens() -> None:
    # position 0 is prompt (sampler logprob 0 there, advantage 0): left out of the ratio.
    # sampled tokens 1, 2: log-ratios ln2 and 0 -> sequence ratio exp(ln2 / 2) = √2,
    # clipped to 1 + 4e-4 for A = +1: loss −(1 + 4e-4), put once on the sequence.
    out, _ = _run(
        "gspo",
        [-5.0, -LN2, -1.0, 0.0],
        logprobs=[0.0, -2 * LN2, -1.0, 0.0],
        advantages=[0.0, 1.0, 1.0, 0.0],
    )
    assert out.loss.item() == pytest.approx(-(1 + 4e-4), abs=1e-6)
    masked, _ = _run(
        "gspo",
        [-5.0, -LN2, -1.0, 0.0],
        logprobs=[0.0, -2 * LN2, -1.0, 0.0],
        advantages=[0.0, 1.0, 1.0, 0.0],
        sequence_ratio_mask=[0.0, 1.0, 1.0, 0.0],
    )
    assert masked.loss.item() == pytest.approx(out.loss.item(), abs=1e-7)
