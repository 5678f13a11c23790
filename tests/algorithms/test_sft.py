"""SFT math: the loss on hand-computed tensors, the packing layout, and packed rows
giving each conversation the logprobs (and loss) it gets alone, to 1e-5."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.sft import (
    SFTLoss,
    finish_metrics,
    loss,
    pack_examples,
    token_mean_nll,
)
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.learner.packing import segment_attention


def test_token_mean_nll_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # (2 + 3 + 0.5) / 3 assistant tokens
    assert float(token_mean_nll(lp, mask, 3.0)) == pytest.approx(5.5 / 3, abs=1e-7)
    with pytest.raises(ValueError, match="must be > 0"):
        token_mean_nll(lp, mask, 0.0)


def test_loss_sums_across_micro_batches_to_the_step_mean():
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -6.0]])
    resp = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    batch = TrainBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), resp, 1)
    batch.loss_denominator = 3.0
    parts = [loss(lp[i : i + 1], batch.select(slice(i, i + 1)), SFTLoss()) for i in (0, 1)]
    assert sum(float(p.loss) for p in parts) == pytest.approx((1 + 2 + 6) / 3, abs=1e-7)
    sums = {k: sum(p.sums[k] for p in parts) for k in parts[0].sums}
    m = finish_metrics(sums)
    assert m["loss"] == pytest.approx(3.0, abs=1e-7)
    assert m["sft/assistant_tokens"] == 3.0


def test_pack_examples_layout():
    a = ([1, 2, 3, 4], [0, 0, 1, 1])
    b = ([5, 6], [0, 1])
    c = ([7, 8, 9], [1, 0, 1])  # a mask on the first token never counts (no context)
    rows = pack_examples([a, b, c], pad_id=0, max_length=6)
    # 9 tokens need 2 rows of <= 6; longest first into the least-filled row: a -> row 0,
    # c -> row 1, b -> row 1 (3 < 4)
    assert rows.placement == [(0, 0), (1, 3), (1, 0)]
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 0], [7, 8, 9, 5, 6]]
    assert rows.segment_ids.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 2, 2]]
    assert rows.response_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 1]]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1] * 5]
    # 2 ranks: 9 tokens fit one row of 12, but the rows come in pairs
    assert pack_examples([a, b, c], 0, 12, rows_multiple=2).input_ids.shape == (2, 5)
    assert pack_examples([a, b, c], 0, 12).input_ids.shape == (1, 9)
    unpacked = pack_examples([a, b, c], pad_id=0, max_length=6, pack=False)
    assert unpacked.segment_ids is None and unpacked.input_ids.shape == (3, 4)
    with pytest.raises(ValueError, match="at most 6"):
        pack_examples([([1] * 7, [1] * 7)], 0, 6)


def test_segment_attention_positions_and_mask():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0]])
    pos, mask = segment_attention(seg)
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0]]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],  # padding attends to itself only
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)
    _, additive = segment_attention(seg, torch.float32)
    assert additive[0, 0, 2, 1] == torch.finfo(torch.float32).min and additive[0, 0, 3, 2] == 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_unpacked(tiny_model, attn):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation=attn
    ).eval()
    g = torch.Generator().manual_seed(1)
    lengths = [9, 5, 13, 4, 7]
    examples = []
    for n in lengths:
        ids = torch.randint(4, 90, (n,), generator=g).tolist()
        mask = (torch.rand(n, generator=g) > 0.4).long().tolist()
        examples.append((ids, mask))
    packed = pack_examples(examples, pad_id=1, max_length=20)
    plain = pack_examples(examples, pad_id=1, max_length=20, pack=False)
    assert packed.input_ids.shape[0] < plain.input_ids.shape[0]  # it did pack

    def logprobs(rows):
        b = rows.batch()
        with torch.no_grad():
            return sequence_logprobs(
                model, b.input_ids, b.attention_mask, 1, segment_ids=b.segment_ids
            )

    lp_packed, lp_plain = logprobs(packed), logprobs(plain)
    for i, (ids, _) in enumerate(examples):
        r, c = packed.placement[i]
        one = lp_packed[r, c + 1 : c + len(ids)]
        alone = lp_plain[i, 1 : len(ids)]
        torch.testing.assert_close(one, alone, rtol=0, atol=1e-5)

    def step_loss(rows, lp):
        b = rows.batch()
        b.loss_denominator = float(b.response_mask.sum())
        return float(loss(lp, b, SFTLoss()).loss)

    assert step_loss(packed, lp_packed) == pytest.approx(step_loss(plain, lp_plain), abs=1e-5)
