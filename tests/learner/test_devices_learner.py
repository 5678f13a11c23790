"""The learner's device keys: gradient checkpointing changes memory, not the step (CPU
here); on a GPU the CUDA rank (NCCL + gloo group, bf16 compute, fp32 master weights)
takes the same step as the CPU rank and reports its CUDA memory."""

from __future__ import annotations

import io

import pytest
import torch

from posttrain.algorithms.common import loss_denominator
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks
from tests.learner.test_fsdp import make_batch


def _rank_main(rank, world, model_path, extra, port, queue):
    w = LearnerWorker(
        rank,
        world,
        LearnerSettings(
            model_path=str(model_path),
            compute_dtype="float32",
            lr=1e-3,
            micro_batch_size=2,
            max_grad_norm=1e9,
            **extra,
        ),
        threads=1,
    )
    report = w.setup(port)
    shard = make_batch().shard(rank, world)
    shard.old_logprobs = w.compute(shard, 0, "old_logprobs")
    shard.loss_denominator = loss_denominator(shard.response_mask, "token_mean")
    stats = w.train_step(shard, step=0)
    after = w._full_state_dict()
    if rank == 0:
        buf = io.BytesIO()
        torch.save((report, stats, shard.old_logprobs, after), buf)
        queue.put(buf.getvalue())
    w.close()


def test_gradient_checkpointing_takes_the_same_step(tiny_model):
    _, plain, lp_plain, after_plain = run_ranks(_rank_main, 1, tiny_model, {})
    _, ckpt, lp_ckpt, after_ckpt = run_ranks(
        _rank_main, 1, tiny_model, {"gradient_checkpointing": True}
    )
    assert torch.equal(lp_plain, lp_ckpt)  # forwards are unchanged
    assert ckpt["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    for k, v in after_plain.items():
        torch.testing.assert_close(after_ckpt[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_rank_matches_the_cpu_rank(tiny_model):
    _, cpu, lp_cpu, after_cpu = run_ranks(_rank_main, 1, tiny_model, {})
    report, gpu, lp_gpu, after_gpu = run_ranks(
        _rank_main, 1, tiny_model, {"device": "cuda", "gradient_checkpointing": True}
    )
    assert report["cuda_peak_mb"] > 0 and gpu["learner_cuda_peak_mb"] >= report["cuda_peak_mb"]
    torch.testing.assert_close(lp_gpu, lp_cpu, rtol=1e-4, atol=1e-4)
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-3)
    for k, v in after_cpu.items():
        torch.testing.assert_close(after_gpu[k], v, rtol=1e-3, atol=1e-4)
