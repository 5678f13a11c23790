"""The LM head only where a logprob is wanted (`sequence_logprobs(..., wanted=)`): same
values and gradients as the whole head masked afterwards, on every path (plain, shared
prompts, packed segments, full logits), and the head sees only the wanted rows."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import posttrain.learner.logprobs as lpmod
from posttrain.learner.logprobs import sequence_logprobs_and_entropy
from posttrain.learner.packing import packed_prompts


def _batch(kind: str):
    """(ids, attention mask, response_start, segment_ids, wanted) of one path's batch."""
    torch.manual_seed(0)
    rows, width, start = (6, 13, 10) if kind == "shared" else (4, 12, 6)
    ids = torch.randint(4, 60, (rows, width))
    mask = torch.ones_like(ids)
    segments = None
    if kind == "shared":  # rows 0-3 share a prompt, rows 4-5 a left-padded one
        ids[1:4, :10] = ids[0, :10]
        ids[4, :3], mask[4, :3] = 1, 0
        ids[5, :10], mask[5, :10] = ids[4, :10], mask[4, :10]
    if kind == "segments":  # SFT rows: conversations packed, loss from column 1 on
        start = 1
        segments = torch.tensor(
            [[1] * 5 + [2] * 7, [1] * 12, [1] * 3 + [2] * 4 + [3] * 5, [1] * 8 + [0] * 4]
        )
        mask = (segments > 0).long()
        ids[3, 8:] = 1
    wanted = torch.zeros(ids.shape)
    wanted[:, start:] = (torch.rand(rows, width - start) < 0.5).float()  # assistant tokens, say
    wanted[0, -1] = 1.0
    wanted *= mask
    return ids, mask, start, segments, wanted


@pytest.mark.parametrize(
    ("kind", "chunk", "share"),
    [("plain", 5, False), ("shared", 4, True), ("segments", 3, False), ("plain", None, False)],
)
def test_wanted_equals_the_whole_head_masked(tiny_model, kind, chunk, share):
    """Values, entropy and every parameter's gradient equal those of the head run on
    every column and masked after, to 1e-6 in fp32; unwanted columns are exactly 0."""
    ids, mask, start, segments, wanted = _batch(kind)
    probe = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = packed_prompts(probe, ids, mask, positions, start)
    assert (packed is not None) == (kind == "shared")  # the path under test is taken
    assert (kind != "segments") or lpmod._segments_apart(probe, probe.config)
    weights = torch.randn(ids.shape)
    runs = []
    for w in (None, wanted):
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        lp, ent = sequence_logprobs_and_entropy(
            m, ids, mask, start, 0.7, chunk, share, segment_ids=segments, wanted=w
        )
        (lp * weights * wanted).sum().backward()
        runs.append((lp.detach(), ent, {n: p.grad for n, p in m.named_parameters()}))
    (full, full_ent, full_g), (got, got_ent, got_g) = runs
    torch.testing.assert_close(got, full * wanted, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_ent, full_ent * wanted, rtol=0, atol=1e-6)
    assert got[wanted == 0].abs().sum() == 0 and got_ent[wanted == 0].abs().sum() == 0
    for name, g in full_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("kind", "share"), [("plain", False), ("shared", True), ("segments", False)]
)
def test_the_head_runs_on_the_wanted_tokens_only(tiny_model, monkeypatch, kind, share):
    ids, mask, start, segments, wanted = _batch(kind)
    seen = []
    real = lpmod.chunked_token_logprobs

    def spy(hidden, weight, targets, *args):
        seen.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return real(hidden, weight, targets, *args)

    monkeypatch.setattr(lpmod, "chunked_token_logprobs", spy)
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        sequence_logprobs_and_entropy(m, ids, mask, start, 1.0, 4, share, segment_ids=segments)
        sequence_logprobs_and_entropy(
            m, ids, mask, start, 1.0, 4, share, segment_ids=segments, wanted=wanted
        )
    every = ids.shape[0] * (ids.shape[1] - start)
    if kind == "segments":  # padding-free rows: only real tokens predicted from real ones
        every = int(((segments[:, start:] > 0) & (segments[:, start - 1 : -1] > 0)).sum())
        assert every < ids.shape[0] * (ids.shape[1] - start)
    assert seen == [every, int(wanted.sum())]


def test_packed_prompts_keep_only_real_response_tokens(tiny_model):
    """A group's packed sequence is its prompt and its responses' real tokens (not G
    padded widths); values on real tokens and every gradient equal the row-by-row pass,
    padding comes back 0; a response with a hole in its mask is not packed."""
    torch.manual_seed(0)
    ids = torch.randint(4, 60, (6, 13))
    mask = torch.ones_like(ids)
    ids[1:4, :10] = ids[0, :10]  # group A: rows 0-3; group B: rows 4-5
    ids[5, :10] = ids[4, :10]
    for row, n in enumerate([3, 1, 2, 3, 2, 3]):  # real response tokens per row
        ids[row, 10 + n :], mask[row, 10 + n :] = 1, 0
    probe = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    pack = packed_prompts(probe, ids, mask, positions, 10)
    # one row, no padding: A is its prompt and 3+1+2+3 tokens, B its prompt and 2+3
    assert pack is not None and pack.input_ids.shape == (1, (10 + 9) + (10 + 5))
    weights = torch.randn(ids.shape)
    runs = []
    for share in (False, True):
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        lp, _ = sequence_logprobs_and_entropy(m, ids, mask, 10, 0.8, 4, share, entropy=False)
        (lp * weights * mask).sum().backward()
        runs.append((lp.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (want, want_g), (got, got_g) = runs
    torch.testing.assert_close(got, want * mask, rtol=0, atol=1e-5)
    assert got[mask == 0].abs().sum() == 0
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=0, atol=1e-5, msg=name)
    holed = mask.clone()
    holed[0, 11], holed[0, 12] = 0, 1
    assert packed_prompts(probe, ids, holed, (holed.cumsum(-1) - 1).clamp(min=0), 10) is None
