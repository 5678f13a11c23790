"""The learner's training state (`save_checkpoint(kind="state")`, `setup(resume_from=)`):
two steps, save, and a fresh group that resumes takes the third step bitwise like an
uninterrupted one (weights, Adam moments, LR warmup); the state reloads on another
number of ranks."""

from __future__ import annotations

import io

import pytest
import torch

from posttrain.algorithms.common import loss_denominator
from posttrain.learner.adapters import AdapterSettings
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks
from tests.learner.test_fsdp import make_batch


def _rank_main(rank, world, model_path, steps, save, resume, adapter, port, queue):
    w = LearnerWorker(
        rank,
        world,
        LearnerSettings(
            model_path=str(model_path),
            compute_dtype="float32",
            lr=1e-2,
            warmup_steps=4,
            micro_batch_size=2,
            adapter=AdapterSettings(type=adapter, r=4, alpha=8),
        ),
        threads=1,
    )
    w.setup(port, resume_from=resume)
    batch = make_batch()
    batch.loss_denominator = loss_denominator(batch.response_mask, "token_mean")
    stats = [w.train_step(batch.shard(rank, world), step) for step in steps]
    if save:
        w.save_checkpoint(save, steps[-1] + 1, kind="state")
    after = w._full_state_dict()
    if rank == 0:
        buf = io.BytesIO()
        torch.save((stats, after, torch.rand(3), w.optimizer_steps), buf)
        queue.put(buf.getvalue())
    w.close()


def _run(model_path, world, steps, save=None, resume=None, adapter="none"):
    return run_ranks(_rank_main, world, model_path, steps, save, resume, adapter)


def test_resumed_learner_steps_like_an_uninterrupted_one(tiny_model, tmp_path):
    ckpt = str(tmp_path / "state")
    straight, w_straight, rng_straight, _ = _run(tiny_model, 2, [0, 1, 2])
    first, w_saved, rng_saved, _ = _run(tiny_model, 2, [0, 1], save=ckpt)
    rest, w_resumed, rng_resumed, n = _run(tiny_model, 2, [2], resume=ckpt)
    assert n == 3
    assert [s["loss"] for s in first + rest] == [s["loss"] for s in straight]
    lrs = [s["lr"] for s in first + rest]
    assert lrs == [s["lr"] for s in straight] and lrs[0] < lrs[1] < lrs[2]  # warmup
    assert all(torch.equal(w_resumed[k], w_straight[k]) for k in w_straight)
    assert torch.equal(rng_resumed, rng_saved)  # the RNG continues from the checkpoint
    # another number of ranks: the same weights load, the schedule continues
    none, w_one, _, n_one = _run(tiny_model, 1, [], resume=ckpt)
    assert n_one == 2 and all(torch.equal(w_one[k], w_saved[k]) for k in w_saved)


@pytest.mark.slow  # 6 learner groups with peft, about 4 min here
@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_adapter_state_resumes(tiny_model, tmp_path, adapter):
    """LoRA / QLoRA: the trainable adapter and its optimizer come back (the NF4 base is
    rebuilt from the model folder, as at any start)."""
    ckpt = str(tmp_path / "state")
    straight, w_straight, _, _ = _run(tiny_model, 2, [0, 1], adapter=adapter)
    first, _, _, _ = _run(tiny_model, 2, [0], save=ckpt, adapter=adapter)
    rest, w_resumed, _, _ = _run(tiny_model, 2, [1], resume=ckpt, adapter=adapter)
    assert [s["loss"] for s in first + rest] == [s["loss"] for s in straight]
    assert all(torch.equal(w_resumed[k], w_straight[k]) for k in w_straight)
