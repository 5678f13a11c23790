"""`weight_sync.shm_gather`: CPU learner ranks hand their shards of a push to rank 0
through shared memory, and rank 0's tensors are bitwise the all-gathered ones, for even
and uneven shards (a rank holding no row of a tensor included)."""

from __future__ import annotations

import io

import torch

from posttrain.learner.push import push_source, untied_state
from posttrain.learner.shm_gather import ShmGather
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks


def _pairs(source) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone()) for n, t in source.tensors]


def _rank_main(rank, world, model_path, port, queue):
    from torch.distributed.fsdp import fully_shard

    settings = LearnerSettings(model_path=str(model_path), compute_dtype="bfloat16")
    w = LearnerWorker(rank, world, settings, threads=1)
    w.setup(port)
    args = (w.policy, rank, str(model_path), settings.adapter, torch.bfloat16, "merged")
    gathered = _pairs(push_source(*args))  # the all-gathers
    shm = _pairs(push_source(*args, w.gather))
    with torch.no_grad():  # a step: the reused buffers must carry the new values
        for p in w.policy.parameters():
            p.to_local().add_(0.125)
    stepped = _pairs(push_source(*args))
    again = _pairs(push_source(*args, w.gather))
    # Uneven shards over 2 ranks: rows (3, 2), (1, 0) (rank 1 holds none) and (1, 1).
    g = torch.Generator().manual_seed(0)
    small = torch.nn.Module()
    small.a = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    small.b = torch.nn.Parameter(torch.randn(1, generator=g))
    small.c = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    fully_shard(small)
    state = untied_state(small)
    gather = ShmGather.create(state, rank, world, torch.bfloat16)
    got = list(gather.stream(state))
    if rank == 0:
        buf = io.BytesIO()
        hand = {"a": small.a.full_tensor(), "b": small.b.full_tensor(), "c": small.c.full_tensor()}
        want = {k: v.detach().to(torch.bfloat16) for k, v in hand.items()}
        torch.save((w.gather is not None, gathered, shm, stepped, again, got, want), buf)
        queue.put(buf.getvalue())
    else:
        for k in ("a", "b", "c"):  # the full_tensor all-gathers are collective
            getattr(small, k).full_tensor()
    w.close()


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.int16), b.view(-1).view(torch.int16))
    )


def test_shm_gather_is_bitwise_the_all_gather(tiny_model):
    made, gathered, shm, stepped, again, got, want = run_ranks(_rank_main, 2, tiny_model)
    assert made  # 2 CPU ranks on this machine: the worker set it up
    assert [n for n, _ in shm] == [n for n, _ in gathered] == [n for n, _ in again]
    assert len(shm) > 5
    for (name, a), (_, b), (_, c), (_, d) in zip(gathered, shm, stepped, again, strict=True):
        assert _bitwise(a, b), name
        assert _bitwise(c, d), name
        assert not _bitwise(a, c), name  # the step changed every tensor
    assert [n for n, _ in got] == ["a", "b", "c"]
    for name, t in got:
        assert _bitwise(t, want[name]), name
    assert [tuple(t.shape) for _, t in got] == [(5, 3), (1,), (2, 2)]


def test_a_shm_without_room_sends_the_push_back_to_the_all_gather(tmp_path):
    """Docker's default /dev/shm is 64 MiB; the buffers need 1.1× their bytes free,
    else `create` returns None (the all-gather) rather than SIGBUS on the first write."""
    from posttrain.learner.shm_gather import _shm_fits

    assert _shm_fits(1, str(tmp_path))
    assert not _shm_fits(10**18, str(tmp_path))
    assert not _shm_fits(1, str(tmp_path / "missing"))
