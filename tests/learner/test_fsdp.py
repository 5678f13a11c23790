"""The FSDP2 learner over gloo: fp32 master weights keep small updates, and the step's
result does not depend on how the batch is split over ranks and micro-batches."""

from __future__ import annotations

import io

import pytest
import torch

from posttrain.algorithms.batch import TrainBatch
from posttrain.algorithms.common import loss_denominator
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks


def make_batch(vocab: int = 90) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    b, t, start = 4, 12, 5
    ids = torch.randint(4, vocab, (b, t), generator=g)
    attn = torch.ones(b, t, dtype=torch.long)
    attn[0, :2] = 0  # left padding on row 0
    attn[3, 10:] = 0  # right padding after a short response on row 3
    resp = torch.zeros(b, t)
    resp[:, start:] = 1.0
    resp[3, 10:] = 0.0
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2]).unsqueeze(-1) * resp
    return TrainBatch(ids, attn, resp, start, advantages=adv)


def make_sft_batch() -> TrainBatch:
    """Seven conversations packed into 4 rows of <= 24 tokens (segment ids, padding),
    the assistant tokens' count as the denominator."""
    from posttrain.algorithms.sft import pack_examples

    g = torch.Generator().manual_seed(2)
    examples = []
    for n in torch.randint(3, 15, (7,), generator=g).tolist():
        ids = torch.randint(4, 90, (n,), generator=g).tolist()
        examples.append((ids, (torch.rand(n, generator=g) > 0.3).long().tolist()))
    batch = pack_examples(examples, pad_id=1, max_length=24, rows_multiple=4).batch()
    batch.loss_denominator = float(batch.response_mask.sum())
    return batch


def _rank_main(rank, world, model_path, mbs, dtype, lr, algo, port, queue):
    from posttrain.algorithms.sft import SFTLoss

    sft = {"algorithm": "sft", "loss": SFTLoss()} if algo == "sft" else {}
    w = LearnerWorker(
        rank,
        world,
        LearnerSettings(
            model_path=str(model_path),
            compute_dtype=dtype,
            lr=lr,
            micro_batch_size=mbs,
            max_grad_norm=1e9,
            **sft,
        ),
        threads=1,
    )
    w.setup(port)
    batch = make_sft_batch() if algo == "sft" else make_batch()
    before = w._full_state_dict()
    shard = batch.shard(rank, world)
    if algo != "sft":
        shard.old_logprobs = w.compute(shard, 0, "old_logprobs")
        shard.loss_denominator = loss_denominator(batch.response_mask, "token_mean")
    stats = w.train_step(shard, step=0)
    after = w._full_state_dict()
    if rank == 0:
        buf = io.BytesIO()  # bytes, not tensors: shared-memory tensors die with this process
        torch.save((stats, before, after), buf)
        queue.put(buf.getvalue())
    w.close()


def run_learners(model_path, world, mbs, dtype, lr, algo="grpo"):
    return run_ranks(_rank_main, world, model_path, mbs, dtype, lr, algo)


def test_small_update_reaches_fp32_master_weights(tiny_model):
    # bf16 compute, lr 1e-6: stored in bf16, this update would vanish below bf16's spacing.
    stats, before, after = run_learners(tiny_model, world=2, mbs=2, dtype="bfloat16", lr=1e-6)
    assert all(v.dtype == torch.float32 for v in after.values())
    layer_keys = [k for k in before if ".layers." in k]
    changed = sum(int((before[k] != after[k]).sum()) for k in layer_keys)
    total = sum(before[k].numel() for k in layer_keys)
    assert changed / total > 0.95, f"only {changed}/{total} layer weights moved"
    assert max((before[k] - after[k]).abs().max().item() for k in layer_keys) < 1e-5
    # the control: the same values rounded to bf16 storage barely move
    bf16_changed = sum(int((before[k].bfloat16() != after[k].bfloat16()).sum()) for k in layer_keys)
    assert bf16_changed / total < 0.2
    assert stats["grad_norm"] > 0


@pytest.mark.parametrize("algo", ["grpo", "sft"])  # sft: packed rows, attention per example
def test_world_and_micro_batch_do_not_change_the_step(tiny_model, algo):
    one = run_learners(tiny_model, world=1, mbs=4, dtype="float32", lr=1e-3, algo=algo)
    two = run_learners(tiny_model, world=2, mbs=1, dtype="float32", lr=1e-3, algo=algo)
    assert one[0]["loss"] == pytest.approx(two[0]["loss"], abs=1e-6)
    assert one[0]["grad_norm"] == pytest.approx(two[0]["grad_norm"], rel=1e-5)
    # sft: seen 1 of an MLP weight's 2048 elements 3.3e-6 apart (loss and grad norm
    # equal): AdamW's first step divides each gradient element by its own size, so an
    # element with a tiny gradient magnifies a summation-order difference
    atol = 1e-5 if algo == "sft" else 1e-6
    for k in one[2]:
        torch.testing.assert_close(one[2][k], two[2][k], rtol=0, atol=atol)
