"""Per-token logprobs: padding invariance and agreement with the rollout engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.learner.logprobs import sequence_logprobs


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _unpadded(model, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("pad_id", [0, 1, 57])
def test_left_padding_changes_nothing(model, pad_id):
    short, long = [5, 9, 13], [7, 8, 30, 31, 40, 41]
    ids = torch.full((2, 6), pad_id)
    ids[0, 3:] = torch.tensor(short)
    ids[1] = torch.tensor(long)
    mask = (torch.arange(6) >= torch.tensor([[3], [0]])).long()
    with torch.no_grad():
        got = sequence_logprobs(model, ids, mask, response_start=1)
    torch.testing.assert_close(got[0, 4:], _unpadded(model, short), rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, 1:], _unpadded(model, long), rtol=0, atol=1e-5)


def test_temperature_divides_logits(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float() / 0.5
        got = sequence_logprobs(model, ids, mask, response_start=1, temperature=0.5)
    want = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got[0, 1:], want, rtol=0, atol=1e-6)


def test_response_start_out_of_range(model):
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="response_start"):
        sequence_logprobs(model, ids, torch.ones_like(ids), response_start=0)
