"""A one-rank learner's push streams its local shards (the whole tensors) instead of a
DTensor cast and a one-rank all-gather per tensor: bitwise the gathered tensors, and
copies, never the live parameters a later optimizer step changes; on a CPU it casts
into buffers reused push after push (`weight_sync.shm_gather`) (the one-rank
all-gather of a float32 push handed out the parameters themselves)."""

from __future__ import annotations

import io

import pytest
import torch

from posttrain.learner.push import push_source, untied_state
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks


def _rank_main(rank, world, model_path, dtype, port, queue):  # noqa: ANN001
    compute = str(dtype).removeprefix("torch.")  # the engines' dtype is the compute one
    settings = LearnerSettings(model_path=str(model_path), compute_dtype=compute)
    w = LearnerWorker(rank, world, settings, threads=1)
    w.setup(port)
    state = untied_state(w.policy)
    want = {n: t.detach().to(dtype).full_tensor().clone() for n, t in state.items()}
    args = (w.policy, rank, str(model_path), settings.adapter, dtype, "merged")
    source = push_source(*args)
    got = dict(source.tensors)
    layout = {n: (d, s) for n, d, s in source.layout}
    shm = [(n, t.clone()) for n, t in push_source(*args, w.gather).tensors]
    with torch.no_grad():  # an update after the push must not reach what was pushed
        for p in w.policy.parameters():
            p.to_local().add_(1.0)
    stepped = {n: t.detach().to(dtype).full_tensor().clone() for n, t in state.items()}
    again = dict(push_source(*args, w.gather).tensors)  # the reused buffers, updated
    buf = io.BytesIO()
    torch.save((want, got, layout, w.gather is not None, dict(shm), stepped, again), buf)
    queue.put(buf.getvalue())
    w.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_rank_pushes_its_shards_whole(tiny_model, dtype):
    want, got, layout, has_gather, shm, stepped, again = run_ranks(_rank_main, 1, tiny_model, dtype)
    assert list(got) == list(want) == list(shm) == list(again)
    assert has_gather  # weight_sync.shm_gather on one CPU rank: reused buffers
    for name, t in want.items():
        assert got[name].dtype == dtype and torch.equal(got[name], t), name
        assert torch.equal(shm[name], t) and torch.equal(again[name], stepped[name]), name
        assert layout[name] == (str(dtype).removeprefix("torch."), tuple(t.shape))
