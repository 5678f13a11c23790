"""CUDA IPC weight hand-off (weightsync/cuda_ipc.py): the handle logic on CPU tensors
and a fake CUDA rebuild here; the real cross-process hand-off on a GPU."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.multiprocessing.reductions as reductions

from posttrain.weightsync import WeightHandle, WeightSyncError, make_transport, publish
from posttrain.weightsync.base import PushSource
from posttrain.weightsync.cuda_ipc import CudaIpcTransport, gpu_uuid, open_shared, share


def test_share_and_open_keep_names_order_and_memory():
    weights = {
        "b.weight": torch.arange(6.0).view(2, 3),
        "a.bias": torch.tensor([1, 2, 3], dtype=torch.int8),
    }
    opened = list(open_shared(share(weights)))
    assert [n for n, _ in opened] == ["b.weight", "a.bias"]
    for (_, got), want in zip(opened, weights.values(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert got.data_ptr() == want.data_ptr()  # the same memory, not a copy
    weights["b.weight"][0, 0] = 42.0
    assert opened[0][1][0, 0] == 42.0


def test_cuda_entries_get_the_receivers_device_index(monkeypatch):
    calls = []

    def fake_rebuild(*args):
        calls.append(args)
        return torch.zeros(1)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", fake_rebuild)
    sender_args = tuple(f"arg{i}" for i in range(15))
    list(open_shared([("w", fake_rebuild, sender_args)], device_index=3))
    assert calls[0][6] == 3  # storage_device: the receiver's numbering of the GPU
    assert calls[0][:6] == sender_args[:6] and calls[0][7:] == sender_args[7:]


def test_engine_without_a_colocated_rank_is_refused():
    handle = WeightHandle(version=1, payload={"GPU-1234": []}, num_bytes=0)
    with pytest.raises(WeightSyncError, match="no learner rank is on this engine's GPU"):
        list(CudaIpcTransport().receive(handle))


def test_cpu_tensors_are_refused():
    with pytest.raises(WeightSyncError, match="resources.device: cuda"):
        CudaIpcTransport().send({"w": torch.zeros(2)}, 1)


def test_recipe_type_builds_the_transport():
    assert isinstance(make_transport("cuda_ipc"), CudaIpcTransport)
    assert gpu_uuid(torch.device("cpu")) == "cpu"


class _Recorder(CudaIpcTransport):
    """Records the collective calls instead of sharing CUDA memory."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def send(self, weights, version):
        self.calls.append(("send", sorted(weights)))
        return WeightHandle(version=version, payload={}, num_bytes=0)

    def finish(self, handle):
        self.calls.append(("finish", handle.version))


@pytest.mark.parametrize("sender", [True, False])
def test_every_rank_sends_and_only_rank_0_hands_out(sender):
    t = _Recorder()
    source = PushSource(iter([("w", torch.ones(2))]), None)
    out = list(publish(t, source, 5, sender=sender))
    assert (out[0] is not None) == sender and len(out) == 1
    assert t.calls == [("send", ["w"]), ("finish", 5)]


def _open_in_child(entries, queue):
    torch.cuda.set_device(0)
    got = dict(open_shared(entries))
    queue.put({n: t.sum().item() for n, t in got.items()})


@pytest.mark.gpu
def test_cuda_ipc_hand_off_between_processes():
    weights = {"w": torch.arange(1024.0, device="cuda"), "v": torch.ones(3, 4, device="cuda")}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(share(weights), queue))
    child.start()
    sums = queue.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0
    assert sums == {"w": float(sum(range(1024))), "v": 12.0}
