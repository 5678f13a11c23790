"""Token-budget micro-batches: whole examples, at most the budget in real tokens,
right padding cut, and the same loss, gradients and update as fixed-size ones."""

from __future__ import annotations

import io

import pytest
import torch

from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.common import loss_denominator
from posttrain.algorithms.grpo import GRPOLoss
from posttrain.learner.micro_batches import plan_rows, trim_right_padding
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks

# real lengths of 8 rows: left pad 0-2, prompt to column 5, responses of varied length
LEFT = [0, 2, 1, 0, 2, 0, 1, 0]
END = [16, 7, 12, 9, 16, 6, 10, 8]  # one past each row's last real column
WIDTH, START = 16, 5


def make_batch(vocab: int = 90) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    b = len(LEFT)
    ids = torch.randint(4, vocab, (b, WIDTH), generator=g)
    attn = torch.zeros(b, WIDTH, dtype=torch.long)
    resp = torch.zeros(b, WIDTH)
    for i, (lo, hi) in enumerate(zip(LEFT, END, strict=True)):
        attn[i, lo:hi] = 1
        resp[i, START:hi] = 1.0
    adv = torch.linspace(-1.0, 1.2, b).unsqueeze(-1) * resp
    return TrainBatch(ids, attn, resp, START, advantages=adv)


def test_plan_packs_longest_first_within_budget():
    attn = make_batch().attention_mask
    lengths = attn.sum(-1).tolist()  # [16, 5, 11, 9, 14, 6, 9, 8]
    plan = plan_rows(attn, unit=1, micro_batch_size=4, max_tokens=20)
    assert [r.tolist() for r in plan] == [[0], [4], [2, 3], [6, 7], [5, 1]]
    assert all(sum(lengths[i] for i in r) <= 20 for r in plan if len(r) > 1)
    assert sorted(torch.cat(plan).tolist()) == list(range(8))


def test_plan_keeps_pairs_and_oversized_rows_alone():
    attn = make_batch().attention_mask
    plan = plan_rows(attn, unit=2, micro_batch_size=4, max_tokens=10)
    assert all(len(r) == 2 and r[0] % 2 == 0 and r[1] == r[0] + 1 for r in plan)
    assert len(plan) == 4  # every pair exceeds 10 tokens: one micro-batch each


def test_plan_splits_to_match_other_ranks():
    attn = make_batch().attention_mask
    plan = plan_rows(attn, unit=1, micro_batch_size=4, max_tokens=1000, at_least=3)
    assert len(plan) == 3 and sorted(torch.cat(plan).tolist()) == list(range(8))


def test_fixed_plan_is_todays_slices():
    plan = plan_rows(make_batch().attention_mask, unit=2, micro_batch_size=3, max_tokens=None)
    assert [r.tolist() for r in plan] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_trim_cuts_only_right_padding():
    mb = trim_right_padding(make_batch().select(torch.tensor([1, 5])))
    assert mb.input_ids.shape == (2, 7) and mb.response_start == START
    assert mb.attention_mask.sum() == 5 + 6


def _rank_main(rank, world, model_path, budget, kind, temperature, port, queue):
    cfg = GRPOLoss(kind=kind)
    w = LearnerWorker(
        rank,
        world,
        LearnerSettings(
            model_path=str(model_path),
            compute_dtype="float32",
            lr=1e-3,
            micro_batch_size=2,
            max_tokens_per_micro_batch=budget,
            max_grad_norm=1e9,
            loss=cfg,
            temperature=temperature,
        ),
        threads=1,
    )
    w.setup(port)
    batch = make_batch()
    shard = batch.shard(rank, world)
    shard.old_logprobs = w.compute(shard, 0, "old_logprobs")
    shard.loss_denominator = loss_denominator(batch.response_mask, cfg.aggregation)
    stats = w.train_step(shard, step=0)
    after = w._full_state_dict()
    if rank == 0:
        buf = io.BytesIO()
        torch.save((stats, shard.old_logprobs, after), buf)
        queue.put(buf.getvalue())
    w.close()


def run_learners(
    model_path, world: int, budget: int | None, kind: str = "ppo_clip", temperature: float = 1.0
):
    return run_ranks(_rank_main, world, model_path, budget, kind, temperature)


@pytest.mark.parametrize("kind", ["ppo_clip", "gspo"])
def test_token_budget_does_not_change_the_step(tiny_model, kind):
    fixed = run_learners(tiny_model, world=1, budget=None, kind=kind)
    # uneven plans: rank 0 packs [0], [2, 3], [1]; rank 1 packs [4, 6], [7, 5] and
    # splits one more so both run 3 forwards (else the FSDP collectives hang)
    budget = run_learners(tiny_model, world=2, budget=23, kind=kind)
    # the policy's entropy, from the loss's own forward: the same whatever the split and
    # order of the rows, and the mean over response tokens of H(softmax(logits / τ))
    assert budget[0]["entropy"] == pytest.approx(fixed[0]["entropy"], abs=1e-6)
    assert fixed[0]["entropy"] == pytest.approx(_hand_entropy(tiny_model, 1.0), abs=1e-5)
    if kind == "gspo":  # ratio 1 at the only update: −mean over the 8 sequences of A_i
        adv = torch.linspace(-1.0, 1.2, len(LEFT))
        assert fixed[0]["loss"] == pytest.approx(-float(adv.mean()), abs=1e-6)
    assert budget[0]["loss"] == pytest.approx(fixed[0]["loss"], rel=1e-5)
    assert budget[0]["grad_norm"] == pytest.approx(fixed[0]["grad_norm"], rel=1e-5)
    torch.testing.assert_close(budget[1], fixed[1][:4], rtol=1e-5, atol=1e-6)
    for k in fixed[2]:
        torch.testing.assert_close(budget[2][k], fixed[2][k], rtol=1e-5, atol=1e-6)
    real = sum(h - lo for lo, h in zip(LEFT, END, strict=True))
    assert fixed[0]["padding_fraction"] == pytest.approx(1 - real / (8 * WIDTH))
    assert budget[0]["padding_fraction"] < fixed[0]["padding_fraction"]


def test_entropy_under_the_sampling_temperature(tiny_model):
    # 2 ranks, token budget: rows reordered by length and split unevenly
    stats = run_learners(tiny_model, world=2, budget=23, temperature=0.7)[0]
    assert stats["entropy"] == pytest.approx(_hand_entropy(tiny_model, 0.7), abs=1e-5)
    assert stats["entropy"] != pytest.approx(_hand_entropy(tiny_model, 1.0), abs=1e-3)


def _hand_entropy(model_path, temperature: float) -> float:
    """Mean over the batch's response tokens of −Σ p log p, p = softmax(logits / τ) of a
    plain transformers forward (position t − 1 predicts column t)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    batch = make_batch()
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions
        ).logits
    logp = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)
    h = -(logp.exp() * logp).sum(-1)  # [B, T − 1]: column t + 1's distribution
    mask = batch.response_mask[:, 1:].double()
    return float((h * mask).sum() / mask.sum())
