"""Per-token logprobs: padding invariance and agreement with the rollout engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.learner.logprobs import sequence_logprobs
from posttrain.learner.packing import packed_prompts, shared_prompts


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


# -- chunked LM head (learner/logprobs.py: ChunkedTokenLogprobs) --------------------------


def _reference(hidden, weight, targets, temperature):
    """The full-logits path: logits [N, V] in float32, log-softmax, gather."""
    from posttrain.algorithms.common import token_logprobs

    return token_logprobs(torch.nn.functional.linear(hidden, weight), targets, temperature)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_values_and_gradients_match_full_logits(chunk, temperature):
    from posttrain.learner.logprobs import chunked_token_logprobs

    g = torch.Generator().manual_seed(0)
    # 14 rows (chunks split them unevenly); logits of a few units, logprobs about -5
    hidden = 0.5 * torch.randn(2, 7, 16, generator=g, dtype=torch.float32)
    weight = 0.5 * torch.randn(97, 16, generator=g, dtype=torch.float32)
    targets = torch.randint(0, 97, (2, 7), generator=g)
    upstream = torch.randn(2, 7, generator=g)  # any loss: a weighted sum of logprobs
    results = []
    for fn in (
        lambda h, w: _reference(h, w, targets, temperature),
        lambda h, w: chunked_token_logprobs(h, w, targets, temperature, chunk),
    ):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h, w)
        (out * upstream).sum().backward()
        results.append((out.detach(), h.grad, w.grad))
    (want, want_h, want_w), (got, got_h, got_w) = results
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # gradients are sums over the vocabulary or the rows: fp32 round-off of another
    # summation order, relative to their size
    torch.testing.assert_close(got_h, want_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)


def test_chunked_hand_values():
    """Two-token vocabulary by hand: logits (0, ln 3) → p = (1/4, 3/4)."""
    from posttrain.learner.logprobs import chunked_token_logprobs

    hidden = torch.tensor([[[1.0]]], requires_grad=True)
    weight = torch.tensor([[0.0], [float(torch.log(torch.tensor(3.0)))]], requires_grad=True)
    out = chunked_token_logprobs(hidden, weight, torch.tensor([[0]]), 1.0, 1)
    torch.testing.assert_close(out, torch.log(torch.tensor([[0.25]])), rtol=0, atol=1e-7)
    out.sum().backward()
    # d log p0 / d logits = (1 - 1/4, -3/4); logits = w·h with h = 1
    torch.testing.assert_close(weight.grad, torch.tensor([[0.75], [-0.75]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(
        hidden.grad, torch.tensor([[[-0.75 * 1.0986123]]]), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sequence_logprobs_chunked_matches_full_on_a_model(tiny_model, temperature):
    """Through a whole model, left padding included: values and every parameter's
    gradient agree with the full-logits path to 1e-6 in fp32."""
    torch.manual_seed(0)
    ids = torch.randint(4, 60, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 1
    weights = torch.randn(3, 9)
    grads = []
    for chunk in (None, 5):
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        out = sequence_logprobs(
            m, ids, mask, response_start=4, temperature=temperature, chunk_tokens=chunk
        )
        (out * weights).sum().backward()
        grads.append((out.detach(), {n: p.grad for n, p in m.named_parameters()}))
        assert "forward" not in vars(m.get_output_embeddings())  # head restored
    (want, want_g), (got, got_g) = grads
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[:, :4].abs().sum() == 0
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=0, atol=1e-6, msg=name)


def test_shared_prompts_by_hand():
    ids = torch.tensor([[1, 2, 7], [1, 2, 8], [3, 4, 9], [1, 2, 5]])
    mask = torch.ones_like(ids)
    first, inverse = shared_prompts(ids, mask, 2)
    assert first[inverse].tolist() == [0, 0, 2, 0]  # rows 0, 1, 3 share one prompt
    assert sorted(first.tolist()) == [0, 2]
    assert shared_prompts(ids, mask, 3) is None  # no two rows equal over 3 columns
    mask[1, 0] = 0  # same ids, another mask: another prompt
    assert shared_prompts(ids[:2], mask[:2], 2) is None


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_shared_prompts_match_one_pass_on_a_model(tiny_model, temperature):
    """Groups of rows with one prompt (one group left-padded, responses right-padded),
    packed one sequence per prompt: the row-by-row values and every parameter's gradient
    to 1e-5 in fp32."""
    torch.manual_seed(0)
    ids = torch.randint(4, 60, (7, 13))
    mask = torch.ones_like(ids)
    ids[1:4, :10] = ids[0, :10]  # rows 0-3: one prompt (columns 0-9)
    ids[4, :3], mask[4, :3] = 1, 0  # rows 4-5: a left-padded prompt
    ids[5, :10], mask[5, :10] = ids[4, :10], mask[4, :10]
    ids[2, 11:], mask[2, 11:] = 1, 0  # a short response; row 6 shares nothing
    weights = torch.randn(7, 13)
    probe = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert packed_prompts(probe, ids, mask, positions, 10) is not None  # the packed path is taken
    runs = []
    for share in (False, True):
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        out = sequence_logprobs(
            m,
            ids,
            mask,
            response_start=10,
            temperature=temperature,
            chunk_tokens=4,
            share_prompts=share,
        )
        (out * weights * mask).sum().backward()
        runs.append((out.detach() * mask, {n: p.grad for n, p in m.named_parameters()}))
    (want, want_g), (got, got_g) = runs
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got[:, :10].abs().sum() == 0
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=0, atol=1e-5, msg=name)


def test_chunk_tokens_must_be_positive(model):
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_tokens"):
        sequence_logprobs(model, ids, torch.ones_like(ids), response_start=1, chunk_tokens=0)


def _fsdp_rank(rank, world, model_path, port, queue, packed=False):
    """Both paths on one FSDP2-sharded policy (tied head, float32 compute): logprobs of
    this rank's rows and the full gradients after each backward. `packed`: three of four
    rows share a prompt, so the chunked path packs them."""
    import io

    import torch.distributed as dist

    from posttrain.learner.logprobs import _plain_head
    from posttrain.learner.models import load_sharded

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = load_sharded(str(model_path), world, "float32", "policy")
    torch.manual_seed(rank)
    rows, width, start = (4, 12, 9) if packed else (2, 9, 3)
    ids = torch.randint(4, 60, (rows, width))
    if packed:
        ids[1:3, :start] = ids[0, :start]
    mask = torch.ones_like(ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = {
        "chunked_head": _plain_head(model) is not None,
        "packed": packed_prompts(model, ids, mask, positions, start) is not None,
    }
    for chunk in (None, 4):
        lp = sequence_logprobs(model, ids, mask, response_start=start, chunk_tokens=chunk)
        (lp * torch.arange(1.0, width + 1.0)).sum().backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        out[chunk] = (lp.detach(), grads)
    dist.destroy_process_group()
    if rank == 0:
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put(buf.getvalue())


def _fsdp_packed_rank(rank, world, model_path, port, queue):
    _fsdp_rank(rank, world, model_path, port, queue, packed=True)


def test_chunked_head_under_fsdp2_matches_full_logits(tiny_model):
    """The chunked path is taken on an FSDP2-wrapped policy (2 ranks) and its values and
    reduced gradients equal the full-logits path's to 1e-6 in fp32."""
    from tests.learner.ranks import run_ranks

    out = run_ranks(_fsdp_rank, 2, tiny_model)
    assert out["chunked_head"] and not out["packed"]
    (want, want_g), (got, got_g) = out[None], out[4]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-6, atol=1e-6, msg=name)


def test_packed_prompts_under_fsdp2_match_full_logits(tiny_model):
    """Rows sharing a prompt, packed into one sequence on an FSDP2-wrapped policy (2
    ranks): values equal the full-logits path's (row by row) to 1e-6 in fp32, reduced
    gradients to 1e-5 (the tied embedding's gradient sums the shared prompt's
    contributions in another order: 3.7e-6 apart at most here)."""
    from tests.learner.ranks import run_ranks

    out = run_ranks(_fsdp_packed_rank, 2, tiny_model)
    assert out["chunked_head"] and out["packed"]
    (want, want_g), (got, got_g) = out[None], out[4]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=0, atol=1e-5, msg=name)


def _compiled_rank(rank, world, model_path, port, queue):
    """One policy eager, one with `torch.compile`d decoder layers (same weights, fp32):
    logprobs and gradients of a plain batch and of one whose rows share a prompt (the
    packed path, a 4-D mask)."""
    import io

    import torch.distributed as dist

    from posttrain.learner.models import load_sharded

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    plain = torch.randint(4, 60, (2, 9))
    shared = torch.randint(4, 60, (4, 12))
    shared[1:3, :9] = shared[0, :9]
    out = {}
    for compiled in (False, True):
        model = load_sharded(str(model_path), world, "float32", "policy", compile_layers=compiled)
        for name, ids, start in (("plain", plain, 3), ("shared", shared, 9)):
            lp = sequence_logprobs(
                model, ids, torch.ones_like(ids), response_start=start, chunk_tokens=4
            )
            (lp * torch.arange(1.0, ids.shape[1] + 1.0)).sum().backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            out[compiled, name] = (lp.detach(), grads)
    from torch._dynamo.utils import counters

    out["graphs"] = counters["stats"]["unique_graphs"]  # dynamo traced the layers
    dist.destroy_process_group()
    buf = io.BytesIO()
    torch.save(out, buf)
    queue.put(buf.getvalue())


def test_compiled_layers_match_eager(tiny_model):
    """`train.compile`: compiled decoder layers under FSDP2 give the eager values to 1e-5
    and gradients to 1e-4 in fp32 (inductor fuses and reorders float sums), on the plain
    and the packed path."""
    from tests.learner.ranks import run_ranks

    out = run_ranks(_compiled_rank, 1, tiny_model)
    assert out["graphs"] >= 1
    for name in ("plain", "shared"):
        (want, want_g), (got, got_g) = out[False, name], out[True, name]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for param, g in want_g.items():
            torch.testing.assert_close(got_g[param], g, rtol=1e-4, atol=1e-5, msg=param)


@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_from_the_same_forward_matches_full_logits(tiny_model, chunk, temperature):
    """The entropy the chunked head computes chunk by chunk (and the full-logits path)
    equals `token_entropy` of the model's logits, and the logprobs do not change."""
    from posttrain.algorithms.common import token_entropy
    from posttrain.learner.logprobs import sequence_logprobs_and_entropy

    torch.manual_seed(1)
    ids = torch.randint(4, 60, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 1
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = m(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        lp, ent = sequence_logprobs_and_entropy(
            m, ids, mask, 4, temperature=temperature, chunk_tokens=chunk
        )
        plain = sequence_logprobs(m, ids, mask, 4, temperature=temperature, chunk_tokens=chunk)
    torch.testing.assert_close(lp, plain, rtol=0, atol=0)
    want = token_entropy(logits[:, 3:-1], temperature)
    torch.testing.assert_close(ent[:, 4:], want, rtol=0, atol=1e-5)
    assert ent[:, :4].abs().sum() == 0


def test_entropy_of_packed_prompts_matches_row_by_row(tiny_model):
    from posttrain.learner.logprobs import sequence_logprobs_and_entropy

    torch.manual_seed(0)
    ids = torch.randint(4, 60, (7, 13))
    mask = torch.ones_like(ids)
    ids[1:4, :10] = ids[0, :10]
    ids[4, :3], mask[4, :3] = 1, 0
    ids[5, :10], mask[5, :10] = ids[4, :10], mask[4, :10]
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert packed_prompts(m, ids, mask, positions, 10) is not None
    with torch.no_grad():
        runs = [
            sequence_logprobs_and_entropy(m, ids, mask, 10, 0.8, 4, share_prompts=share)[1]
            for share in (False, True)
        ]
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=1e-5)
