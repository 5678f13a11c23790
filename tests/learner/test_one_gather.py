"""One learner rank casts its weights into the compute copy once per optimizer step
(learner/models.py `one_gather_per_step`), not twice per micro-batch, and the step's
update, its metrics and the no-grad passes around it are those of FSDP2's defaults."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from posttrain.algorithms.common import loss_denominator
from posttrain.algorithms.grpo import GRPOLoss
from posttrain.learner import worker as worker_module
from posttrain.learner.adapters import AdapterSettings
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks
from tests.learner.test_micro_batches import make_batch

REDUCE = "FSDP::post_backward_reduce (model.layers.0)"  # FSDP2's span: a layer's grads out
COPY = "aten::copy_"


def _defaults(models, world):  # noqa: ANN001, ANN202, ARG001
    """`one_gather_per_step` as it was before: FSDP2's defaults on every rank."""
    from contextlib import nullcontext

    return nullcontext(lambda last: None)


def _rank_main(rank, world, model_path, dtype, kept, lora, port, queue):  # noqa: ANN001
    if not kept:
        worker_module.one_gather_per_step = _defaults
    cfg = GRPOLoss()
    adapter = {"type": "lora", "r": 4, "alpha": 8} if lora else None
    s = LearnerSettings(
        model_path=str(model_path),
        compute_dtype=dtype,
        lr=1e-2,  # big enough that a stale compute copy would show in the next pass
        micro_batch_size=2,  # 4 micro-batches of the 8 rows
        max_grad_norm=1e9,
        loss=cfg,
        **({"adapter": AdapterSettings(**adapter)} if lora else {}),
    )
    w = LearnerWorker(rank, world, s, threads=1)
    w.setup(port)
    batch = make_batch()
    batch.old_logprobs = w.compute(batch, 0, "old_logprobs")
    batch.loss_denominator = loss_denominator(batch.response_mask, cfg.aggregation)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        first = w.train_step(batch, step=0)
    copies = Counter(e.name for e in prof.events() if e.name in (REDUCE, COPY))
    after_one = w.compute(batch, 1, "old_logprobs")  # a no-grad pass between steps
    second = w.train_step(batch, step=1)
    after_two = w.compute(batch, 2, "old_logprobs")
    buf = io.BytesIO()
    torch.save((first, second, after_one, after_two, w._full_state_dict(), copies), buf)
    queue.put(buf.getvalue())
    w.close()


def _run(model_path, dtype: str, kept: bool, lora: bool = False):  # noqa: ANN001, ANN202
    return run_ranks(_rank_main, 1, model_path, dtype, kept, lora)


@pytest.mark.parametrize(
    ("dtype", "lora", "tol"),
    [
        pytest.param("float32", False, 1e-6, marks=pytest.mark.slow),  # float32 LoRA kept
        ("bfloat16", False, 1e-3),
        ("float32", True, 1e-6),
    ],
)
def test_one_copy_a_step_changes_nothing_else(tiny_model, dtype, lora, tol):
    new = _run(tiny_model, dtype, kept=True, lora=lora)
    old = _run(tiny_model, dtype, kept=False, lora=lora)
    # FSDP2's defaults: a layer's gradients go to its shard at each of the 4 micro-batches;
    # kept: accumulated unsharded, once a step, and fewer copies in all (one rank's LoRA
    # weights are outside FSDP2: learner/adapters.py `fsdp_ignored_params`)
    assert (old[5][REDUCE], new[5][REDUCE]) == ((0, 0) if lora else (4, 1))
    assert new[5][COPY] < old[5][COPY]
    for key in ("loss", "grad_norm", "entropy"):
        assert new[0][key] == pytest.approx(old[0][key], rel=tol, abs=tol)
        assert new[1][key] == pytest.approx(old[1][key], rel=tol, abs=tol)
    # the passes after each update see the updated weights (no stale compute copy)
    assert not torch.allclose(new[2], new[3])
    torch.testing.assert_close(new[2], old[2], rtol=tol, atol=tol)
    torch.testing.assert_close(new[3], old[3], rtol=tol, atol=tol)
    for k in old[4]:
        torch.testing.assert_close(new[4][k], old[4][k], rtol=tol, atol=tol)
