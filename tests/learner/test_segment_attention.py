"""Attention per packed example (`segment_sdpa`): hand values, and the SFT loss and
gradients equal to the block-mask path's, whatever the packing order or padding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.algorithms.sft import SFTLoss, loss, pack_examples
from posttrain.learner import logprobs as logprobs_module
from posttrain.learner.attention import (
    SEGMENT_ATTENTION,
    run_buckets,
    segment_attention_on,
    segment_sdpa,
)
from posttrain.learner.logprobs import sequence_logprobs, sequence_logprobs_and_entropy
from posttrain.learner.packing import (
    PackedGroups,
    PaddingFree,
    PromptPacking,
    packed_prompts,
    segment_runs,
)


def test_segment_runs_by_hand():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 0, 0, 0]])
    # a run ends at each change of id and at each row's end
    assert segment_runs(seg) == [2, 3, 1, 3, 3]


def test_run_buckets_by_hand():
    # longest first; a bucket keeps runs >= its longest / sqrt(2): 10 -> 8 (8·1.41 >= 10),
    # 7 opens a new bucket (7·1.41 < 10), 5 joins it (5·1.41 >= 7), 3 alone
    assert run_buckets([5, 10, 3, 8, 7]) == [[1, 3], [4, 0], [2]]
    assert run_buckets([4, 4]) == [[0, 1]]


def test_segment_sdpa_by_hand():
    # q = k = 0: uniform weights over the keys a query sees, so each output is the mean
    # of the values from its run's start to itself.
    v = torch.tensor([1.0, 2, 3, 4, 5, 6]).view(1, 1, 6, 1)
    zero = torch.zeros(1, 1, 6, 1)
    out, weights = segment_sdpa(torch.nn.Module(), zero, zero, v, None, segment_runs=[2, 3, 1])
    assert weights is None and out.shape == (1, 6, 1, 1)
    expected = [1.0, 1.5, 3.0, 3.5, 4.0, 6.0]
    torch.testing.assert_close(out.view(-1), torch.tensor(expected), rtol=0, atol=1e-6)
    # runs of 1 and 5 fall in two buckets: the same means
    out, _ = segment_sdpa(torch.nn.Module(), zero, zero, v, None, segment_runs=[1, 5])
    expected = [1.0, 2.0, 2.5, 3.0, 3.5, 4.0]
    torch.testing.assert_close(out.view(-1), torch.tensor(expected), rtol=0, atol=1e-6)
    # one run: the plan is the identity (views, no gather)
    out, _ = segment_sdpa(torch.nn.Module(), zero, zero, v, None, segment_runs=[6])
    expected = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    torch.testing.assert_close(out.view(-1), torch.tensor(expected), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="segment_runs"):
        segment_sdpa(torch.nn.Module(), zero, zero, v, None)
    with pytest.raises(ValueError, match="no mask"):
        segment_sdpa(torch.nn.Module(), zero, zero, v, torch.ones(1, 1, 6, 6), segment_runs=[6])
    with pytest.raises(ValueError, match="summing"):
        segment_sdpa(torch.nn.Module(), zero, zero, v, None, segment_runs=[2, 3])
    with pytest.raises(ValueError, match="sliding_window"):
        segment_sdpa(torch.nn.Module(), zero, zero, v, None, segment_runs=[6], sliding_window=4)


def test_padding_free_by_hand():
    seg = torch.tensor([[1, 1, 2, 2, 0], [1, 1, 1, 0, 0]])
    ids = torch.tensor([[10, 11, 12, 13, 0], [20, 21, 22, 0, 0]])
    flat = PaddingFree.build(ids, seg, 1)
    assert flat.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22]]
    assert flat.positions.tolist() == [[0, 1, 0, 1, 0, 1, 2]]
    assert flat.runs == [2, 2, 3]
    # response column c (c >= 1) is predicted from column c - 1's flat index
    assert flat.real.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert flat.columns.tolist() == [[0, 1, 2, 0], [4, 5, 0, 0]]
    assert flat.rows.tolist() == [[0] * 4, [0] * 4]
    # a row's last example and the next row's first stay two runs, though both are id 1
    both = PaddingFree.build(
        torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long), 1
    )
    assert both.runs == [2, 2] and both.positions.tolist() == [[0, 1, 0, 1]]


@pytest.mark.parametrize("chunk_tokens", [512, None], ids=["chunked_head", "full_logits"])
def test_the_packed_forward_computes_no_padding(model, chunk_tokens):
    """The decoder sees one row of the real tokens; logprobs equal the block mask's on
    real tokens and are 0 on padding, with the chunked head and with full logits."""
    b = pack_examples(_examples(), pad_id=1, max_length=24).batch()
    seen = []
    hook = model.model.embed_tokens.register_forward_pre_hook(
        lambda _m, args: seen.append(tuple(args[0].shape))
    )
    try:
        with torch.no_grad():
            lp = sequence_logprobs(
                model,
                b.input_ids,
                b.attention_mask,
                1,
                chunk_tokens=chunk_tokens,
                segment_ids=b.segment_ids,
            )
    finally:
        hook.remove()
    real = int((b.segment_ids > 0).sum())
    assert b.input_ids.numel() > real  # the packing left padding to skip
    assert seen == [(1, real)]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with torch.no_grad():  # checkpointed: the block mask over the padded rows
        masked = sequence_logprobs(
            model,
            b.input_ids,
            b.attention_mask,
            1,
            chunk_tokens=chunk_tokens,
            segment_ids=b.segment_ids,
        )
    keep = (b.segment_ids[:, 1:] > 0) & (b.segment_ids[:, :-1] > 0)
    torch.testing.assert_close(lp[:, 1:][keep], masked[:, 1:][keep], rtol=0, atol=1e-5)
    assert (lp[:, 1:][~keep] == 0).all()


def test_group_blocks_by_hand():
    # one run [p0 p1 | r1 r1 | r2], q = k = 0: each output is the mean of the values a
    # token sees: the prompt before it and its own response before it
    v = torch.tensor([1.0, 2, 3, 4, 5]).view(1, 1, 5, 1)
    zero = torch.zeros(1, 1, 5, 1)
    blocks = torch.tensor([0, 0, 1, 1, 2])
    out, _ = segment_sdpa(
        torch.nn.Module(), zero, zero, v, None, segment_runs=[5], segment_blocks=blocks
    )
    expected = [1.0, 1.5, 2.0, 2.5, 8 / 3]
    torch.testing.assert_close(out.view(-1), torch.tensor(expected), rtol=0, atol=1e-6)
    # two groups in two buckets (runs 2 and 5): each sees its own group only
    v2 = torch.tensor([7.0, 9, 1, 2, 3, 4, 5]).view(1, 1, 7, 1)
    z2 = torch.zeros(1, 1, 7, 1)
    out, _ = segment_sdpa(
        torch.nn.Module(),
        z2,
        z2,
        v2,
        None,
        segment_runs=[2, 5],
        segment_blocks=torch.tensor([0, 1, 0, 0, 1, 1, 2]),
    )
    torch.testing.assert_close(out.view(-1), torch.tensor([7.0, 8.0, *expected]), atol=1e-6, rtol=0)


def test_packed_groups_by_hand(tiny_model):
    # rows 0-1 share a left-padded prompt (2 real of 3 columns), rows 2-3 another (3 real)
    ids = torch.tensor([[0, 5, 6, 50, 51], [0, 5, 6, 52, 0], [7, 8, 9, 60, 0], [7, 8, 9, 61, 62]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    probe = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    probe.config.hidden_size = 4096  # make packing_pays say yes at this toy size
    pack = packed_prompts(probe, ids, mask, positions, 3)
    assert isinstance(pack, PackedGroups)
    assert pack.input_ids.tolist() == [[5, 6, 50, 51, 52, 7, 8, 9, 60, 61, 62]]
    assert pack.positions.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3, 3, 4]]
    assert pack.runs == [5, 6]
    assert pack.blocks.tolist() == [0, 0, 1, 1, 2, 0, 0, 0, 1, 2, 2]
    # a response's first token is predicted by its prompt's last (flat 1, flat 7)
    assert pack.columns.tolist() == [[1, 2], [1, 0], [7, 0], [7, 9]]
    assert pack.real.tolist() == [[True, True], [True, False], [True, False], [True, True]]
    # layers that recompute in backward keep the padded rows under a mask
    probe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    probe.train()
    assert isinstance(packed_prompts(probe, ids, mask, positions, 3), PromptPacking)


def _examples(count: int = 7, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in torch.randint(3, 15, (count,), generator=g).tolist():
        ids = torch.randint(4, 90, (n,), generator=g).tolist()
        mask = (torch.rand(n, generator=g) > 0.3).long().tolist()
        out.append((ids, mask))
    return out


def _step(model, examples, max_length: int, masked: bool, monkeypatch):
    """Loss, entropy sum and gradients of one SFT step over `examples` packed."""
    monkeypatch.setattr(logprobs_module, "_segments_apart", lambda *_: not masked)
    model.zero_grad()
    b = pack_examples(examples, pad_id=1, max_length=max_length).batch()
    b.loss_denominator = float(b.response_mask.sum())
    lp, ent = sequence_logprobs_and_entropy(
        model, b.input_ids, b.attention_mask, 1, segment_ids=b.segment_ids
    )
    value = loss(lp, b, SFTLoss()).loss
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(value.detach()), float((ent * b.response_mask).sum().detach()), grads


@pytest.fixture
def model(tiny_model):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="sdpa"
    )


def test_per_example_attention_equals_the_block_mask(model, monkeypatch):
    examples = _examples()
    loss_m, ent_m, grads_m = _step(model, examples, 24, True, monkeypatch)
    loss_s, ent_s, grads_s = _step(model, examples, 24, False, monkeypatch)
    assert loss_s == pytest.approx(loss_m, abs=1e-6)
    assert ent_s == pytest.approx(ent_m, abs=1e-5)
    for name, g in grads_m.items():
        torch.testing.assert_close(grads_s[name], g, rtol=0, atol=1e-6, msg=name)
    assert model.config._attn_implementation == "sdpa"  # switched back


def test_packing_order_and_padding_do_not_change_the_loss(model, monkeypatch):
    examples = _examples()
    base, _, grads = _step(model, examples, 24, False, monkeypatch)
    for order, width in ((list(reversed(examples)), 24), (examples[3:] + examples[:3], 40)):
        value, _, other = _step(model, order, width, False, monkeypatch)
        assert value == pytest.approx(base, abs=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(other[name], g, rtol=0, atol=1e-6, msg=name)


def test_gradient_checkpointing_keeps_the_block_mask(model, monkeypatch):
    """The recompute in backward would run plain SDPA: the mask path is taken instead."""
    examples = _examples()
    plain, _, grads = _step(model, examples, 24, False, monkeypatch)
    monkeypatch.undo()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seen = []
    real = logprobs_module.segment_attention_on
    monkeypatch.setattr(
        logprobs_module, "segment_attention_on", lambda c: seen.append(c) or real(c)
    )
    model.zero_grad()
    b = pack_examples(examples, pad_id=1, max_length=24).batch()
    b.loss_denominator = float(b.response_mask.sum())
    lp, _ = sequence_logprobs_and_entropy(
        model, b.input_ids, b.attention_mask, 1, segment_ids=b.segment_ids
    )
    value = loss(lp, b, SFTLoss()).loss
    value.backward()
    assert seen == []
    assert float(value.detach()) == pytest.approx(plain, abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-6, msg=name)


def test_the_attention_is_switched_back_on_error(model):
    with pytest.raises(RuntimeError, match="boom"), segment_attention_on(model.config):
        assert model.config._attn_implementation == SEGMENT_ATTENTION
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
