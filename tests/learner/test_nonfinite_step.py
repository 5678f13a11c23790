"""The learner never applies a non-finite loss or gradient: a step whose loss or grad
norm is NaN or infinite leaves the weights, AdamW's moments and step counts, the LR
schedule and the optimizer-step count as they were, reports `skipped_updates` and warns;
the next finite step trains as usual. On 2 FSDP2 ranks with the bad row on rank 1 only,
so both ranks must agree to skip."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from posttrain.algorithms.common import loss_denominator
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks
from tests.learner.test_fsdp import make_batch


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _snapshot(w: LearnerWorker) -> tuple[list, list]:
    """This rank's shards of the policy's parameters and of AdamW's state."""
    params = [_local(p) for p in w.policy.parameters()]
    opt = w.optimizers[0]
    state = [
        {k: _local(v) if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        for p in w.policy.parameters()
        if p in opt.state
    ]
    return params, state


def _same(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    if len(sa) != len(sb) or not all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True)):
        return False
    return all(
        set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(sa, sb, strict=True)
    )


def _rank_main(rank, world, model_path, bad, port, queue):
    w = LearnerWorker(
        rank,
        world,
        LearnerSettings(
            model_path=str(model_path),
            compute_dtype="float32",
            lr=1e-2,
            warmup_steps=3,
            micro_batch_size=1,
        ),
        threads=1,
    )
    w.setup(port)
    good = make_batch()
    good.loss_denominator = loss_denominator(good.response_mask, "token_mean")
    broken = make_batch()
    broken.advantages[3] *= bad  # row 3: rank 1's second row
    broken.loss_denominator = good.loss_denominator
    stats = [w.train_step(good.shard(rank, world), 0)]
    before, lr_next, steps = _snapshot(w), w.scheduler.get_last_lr()[0], w.optimizer_steps
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        stats.append(w.train_step(broken.shard(rank, world), 1))
    unchanged = _same(_snapshot(w), before)
    grads_dropped = all(p.grad is None for p in w.policy.parameters())
    kept = (w.scheduler.get_last_lr()[0] == lr_next, w.optimizer_steps == steps)
    stats.append(w.train_step(good.shard(rank, world), 2))
    moved = not _same(_snapshot(w), before)
    if rank == 0:
        buf = io.BytesIO()
        torch.save((stats, unchanged, grads_dropped, kept, moved, err.getvalue()), buf)
        queue.put(buf.getvalue())
    w.close()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_step_is_skipped(tiny_model, bad):
    stats, unchanged, grads_dropped, kept, moved, warned = run_ranks(_rank_main, 2, tiny_model, bad)
    assert unchanged and grads_dropped  # weights and AdamW moments/steps did not move
    assert [s["skipped_updates"] for s in stats] == [0.0, 1.0, 0.0]
    assert not math.isfinite(stats[1]["grad_norm"]) or not math.isfinite(stats[1]["loss"])
    assert kept == (True, True)  # the LR schedule and step count wait for a real update
    assert stats[2]["lr"] == stats[1]["lr"] == pytest.approx(2e-2 / 3)  # warmup step 1 of 3
    assert moved and math.isfinite(stats[2]["loss"])
    assert "warning: step 1" in warned and "skipped" in warned
