"""Every transport moves weights exactly (fp32 and bf16, tied names included); the
collective one in aligned buckets, failing with a named error instead of hanging; the
filesystem one atomically, keeping only the last two versions."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from posttrain.common.net import free_port
from posttrain.weightsync import (
    GroupStore,
    TransportSettings,
    WeightSyncError,
    make_transport,
)
from posttrain.weightsync.base import WeightHandle
from posttrain.weightsync.buckets import bucket_layout
from posttrain.weightsync.collective import CollectiveTransport
from posttrain.weightsync.verify import fingerprints


def _weights(dtype):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 16, generator=g).to(dtype)
    return {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": emb,
        "model.norm.weight": torch.randn(16, generator=g).to(dtype),
        "odd": torch.randn(3, 7, generator=g).to(dtype),
        "big": torch.randn(300, 300, generator=g).to(dtype),
    }


_STORES: list[GroupStore] = []  # the rendezvous stays hosted while the test runs


def _group(settings: TransportSettings, receivers: int):
    members = [make_transport(settings) for _ in range(receivers + 1)]
    _STORES.append(GroupStore(receivers + 1, 60))
    address = _STORES[-1].address
    threads = [
        threading.Thread(target=m.join_group, args=(address, r, receivers + 1))
        for r, m in enumerate(members)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return members


def _receive_all(transport, handle, out, key):
    try:
        out[key] = {n: t.clone() for n, t in transport.receive(handle)}
    except WeightSyncError as e:
        out[key] = e


def _push_one(sender, engine, sent, version, receive=_receive_all):
    """One push from `sender` to one `engine`, asserted exact; its handle."""
    handle = sender.send(sent, version=version)
    out = {}
    t = threading.Thread(target=receive, args=(engine, handle, out, 0))
    t.start()
    t.join()
    sender.finish(handle)
    got = out[0]
    assert set(got) == set(sent)
    assert all(torch.equal(got[k], v) for k, v in sent.items())
    return handle


def test_bucket_layout_packs_in_order_and_aligns():
    w = {
        "a": torch.zeros(10),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "c": torch.zeros(1000),
        "d": torch.zeros(2),
    }
    layout = bucket_layout(w, bucket_bytes=256)
    names = [[e[0] for e in b["entries"]] for b in layout]
    assert names == [["a", "b"], ["c"], ["d"]]  # c (4000 B) exceeds a bucket: its own
    assert [e[3] for e in layout[0]["entries"]] == [0, 64]  # 40 B rounded up to 64
    assert layout[1]["size"] == 4032 and layout[2]["entries"][0][4] == 8


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collective_broadcast_is_exact_for_every_engine(dtype, shm):
    sender, *engines = _group(
        TransportSettings("collective", bucket_mb=0.1, timeout_s=30, shm_broadcast=shm), 2
    )
    assert sender.shm is shm  # every engine here shares this /dev/shm
    sent = _weights(dtype)
    handle = sender.send(sent, version=4)
    assert len(handle.payload) >= 2 and set(handle.names) == set(sent)
    assert all(("shm" in b) is shm for b in handle.payload)
    out = {}
    threads = [
        threading.Thread(target=_receive_all, args=(e, handle, out, i))
        for i, e in enumerate(engines)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sender.finish(handle)
    for i in range(2):
        got = out[i]
        assert set(got) == set(sent)
        for k, v in sent.items():
            assert got[k].dtype == dtype and torch.equal(got[k], v)


def test_collective_keeps_its_cpu_buffers_and_every_push_is_exact():
    # The bucket buffers are reused push after push on CPU (fresh pages cost ~6x the
    # copy); a second push with other values must still arrive exactly, in the same memory.
    sender, engine = _group(
        TransportSettings("collective", bucket_mb=0.1, timeout_s=30, shm_broadcast=False), 1
    )
    pushes = [_weights(torch.bfloat16), {k: v + 1 for k, v in _weights(torch.bfloat16).items()}]
    seen_ptrs = []
    for version, sent in enumerate(pushes, start=1):
        handle = _push_one(sender, engine, sent, version)
        seen_ptrs.append(
            sorted(b.data_ptr() for b in (*sender._kept.values(), *engine._kept.values()))
        )
    assert len(seen_ptrs[0]) == 2 * len(handle.payload)  # one per bucket on each side
    assert seen_ptrs[0] == seen_ptrs[1]


def _shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("posttrain-push-*")} | {
        p.name for p in Path("/dev/shm").glob("posttrain-probe-*")
    }


def test_shared_memory_buckets_are_kept_exact_and_leave_no_file():
    # Rank 0 packs into /dev/shm files the engine maps; the files are unlinked once the
    # push is delivered, the mappings are reused while the layout holds, and a layout of
    # other sizes gets new files (new names: no engine can take a stale mapping).
    before = _shm_files()
    sender, engine = _group(TransportSettings("collective", bucket_mb=0.1, timeout_s=30), 1)
    assert sender.shm and _shm_files() == before  # the probe is gone
    first, second = (
        _weights(torch.bfloat16),
        {k: v + 1 for k, v in _weights(torch.bfloat16).items()},
    )
    h1 = _push_one(sender, engine, first, 1)
    assert _shm_files() == before and not sender._kept and not engine._kept
    ptrs = sorted(t.data_ptr() for t in engine._files.mapped.values())
    h2 = _push_one(sender, engine, second, 2)
    assert [b["shm"] for b in h2.payload] == [b["shm"] for b in h1.payload]
    assert sorted(t.data_ptr() for t in engine._files.mapped.values()) == ptrs
    grown = {**second, "big": torch.zeros(400, 300, dtype=torch.bfloat16)}
    h3 = _push_one(sender, engine, grown, 3)
    assert h3.payload[-1]["shm"] != h2.payload[-1]["shm"]  # that bucket outgrew its file
    assert h3.payload[0]["shm"] == h2.payload[0]["shm"]
    assert set(engine._files.mapped) == {b["shm"] for b in h3.payload}  # the old one unmapped
    # Smaller buckets (a delta push's) reuse the files: none made, none left.
    shrunk = {**second, "big": torch.ones(200, 300, dtype=torch.bfloat16)}
    h4 = _push_one(sender, engine, shrunk, 4)
    assert [b["shm"] for b in h4.payload] == [b["shm"] for b in h3.payload]
    assert h4.payload[-1]["size"] < h4.payload[-1]["shm_bytes"]
    assert _shm_files() == before


def test_a_failed_shared_memory_push_leaves_no_file_and_forgets_its_files():
    # gloo closes the group after a timeout (a run re-forms it); the sender must not
    # keep the unlinked files for a later push, which makes new ones.
    before = _shm_files()
    sender, _ = _group(TransportSettings("collective", timeout_s=2), 1)
    handle = sender.send(_weights(torch.float32), version=9)
    with pytest.raises(WeightSyncError, match="policy_version 9"):
        sender.finish(handle)  # the engine never received
    assert _shm_files() == before and not sender._files.out
    assert sender._files.assign([{"size": 64, "entries": []}])[0]["shm"] != handle.payload[0]["shm"]
    sender.close()
    assert _shm_files() == before


def test_engines_that_do_not_see_the_probe_get_the_bytes_over_gloo():
    # An engine in another /dev/shm (another machine or IPC namespace) answers "0": rank
    # 0 then sends every byte over gloo, and the push is exact.
    class Elsewhere(CollectiveTransport):
        def _settle_shm(self, rank, world_size, probe):
            if rank != 0:
                self._store.set(f"posttrain/shm_seen/{rank}", "0")
                return
            super()._settle_shm(rank, world_size, probe)

    members = [Elsewhere(timeout_s=30), Elsewhere(timeout_s=30)]
    _STORES.append(GroupStore(2, 60))
    threads = [
        threading.Thread(target=m.join_group, args=(_STORES[-1].address, r, 2))
        for r, m in enumerate(members)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sender, engine = members
    assert sender.shm_asked and not sender.shm
    h = _push_one(sender, engine, _weights(torch.float32), 1)
    assert all("shm" not in b for b in h.payload)


def test_a_receiver_that_never_answers_the_probe_fails_the_join_by_name():
    class Silent(CollectiveTransport):
        def _settle_shm(self, rank, world_size, probe):
            if rank != 0:
                return  # joined the group, then never said whether it sees /dev/shm
            super()._settle_shm(rank, world_size, probe)

    before = _shm_files()
    members = [Silent(timeout_s=2), Silent(timeout_s=2)]
    _STORES.append(GroupStore(2, 60))
    errors = {}

    def join(r, m):
        try:
            m.join_group(_STORES[-1].address, r, 2)
        except WeightSyncError as e:
            errors[r] = e

    threads = [threading.Thread(target=join, args=(r, m)) for r, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert list(errors) == [0] and "rank 0 could not join" in str(errors[0])
    assert _shm_files() == before  # the probe is gone


def test_a_receiver_without_the_file_names_the_key_to_turn_it_off():
    sender, engine = _group(TransportSettings("collective", timeout_s=2), 1)
    handle = sender.send(_weights(torch.float32), version=3)
    lost = {**handle.payload[0], "shm": "/dev/shm/posttrain-push-gone-0"}
    bad = WeightHandle(3, [lost, *handle.payload[1:]], handle.num_bytes, names=handle.names)
    with pytest.raises(WeightSyncError, match="shm_broadcast: false"):
        next(engine.receive(bad))
    with pytest.raises(WeightSyncError):
        sender.finish(handle)


def test_a_broadcast_still_running_after_finish_blocks_the_next_push():
    # Its thread may still read the kept buffers: a new push must not write into them.
    sender = CollectiveTransport(timeout_s=0.01)  # finish waits timeout + 10 s
    release = threading.Event()
    sender.pg = object()  # a group, as far as send's checks go
    sender._thread = threading.Thread(target=release.wait, daemon=True)
    sender._thread.start()
    with pytest.raises(WeightSyncError, match="still running"):
        sender.finish(WeightHandle(version=3, payload=[], num_bytes=0))
    with pytest.raises(WeightSyncError, match="started before the previous push finished"):
        sender.send({"w": torch.zeros(2)}, version=4)
    release.set()


def test_collective_push_to_a_missing_engine_fails_with_the_version():
    sender, engine = _group(TransportSettings("collective", timeout_s=2), 1)
    handle = sender.send(_weights(torch.float32), version=9)
    # the engine never receives: the sender's broadcast times out instead of hanging
    with pytest.raises(WeightSyncError, match="policy_version 9"):
        sender.finish(handle)
    with pytest.raises(WeightSyncError, match="before the previous push|no group"):
        make_transport("collective").send({}, version=1)


def test_collective_join_fails_when_peers_never_come():
    lone = make_transport(TransportSettings("collective", timeout_s=2))
    with pytest.raises(WeightSyncError, match="could not join"):
        lone.join_group(f"127.0.0.1:{free_port()}", 0, 2)


def test_a_second_group_on_a_used_store_fails_at_once_naming_the_fix():
    # The first group's members stay alive (engines that were pushed to). Its rendezvous
    # keys (each rank's address) stay in the store: a second group on the same store once
    # connected to those members, "formed" at once and then hung its pushes for timeout_s
    # (bench/weight_sync.py's collective + vLLM row, engines stuck in their constructor).
    settings = TransportSettings("collective", timeout_s=5)
    first = _group(settings, 1)
    again = make_transport(settings)
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match=r"already formed a push group.*new GroupStore"):
        again.join_group(_STORES[-1].address, 0, 2)
    assert time.perf_counter() - t0 < 2.0  # at once, not after timeout_s
    assert first[0].pg is not None  # the formed group is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filesystem_round_trip_and_cleanup(tmp_path, dtype):
    t = make_transport(TransportSettings("filesystem", directory=str(tmp_path / "w")))
    sent = _weights(dtype)
    handles = [t.send(sent, version=v) for v in (1, 2, 3)]
    got = dict(t.receive(handles[-1]))
    assert set(got) == set(sent)
    assert all(torch.equal(got[k], v) for k, v in sent.items())
    files = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert files == ["policy_v2.safetensors", "policy_v3.safetensors"]
    with pytest.raises(WeightSyncError, match="policy_version 1"):
        list(t.receive(handles[0]))
    t.close()
    assert not (tmp_path / "w").exists()  # the run folder goes too


def test_object_store_round_trip_with_tied_names(ray_local):
    t = make_transport("object_store")
    sent = _weights(torch.bfloat16)
    handle = t.send(sent, version=2)
    got = dict(t.receive(handle))
    assert set(got) == set(sent)
    assert all(torch.equal(got[k], v) for k, v in sent.items())


def test_unknown_transport_names_the_choices():
    with pytest.raises(ValueError, match="object_store, collective, filesystem"):
        make_transport("carrier_pigeon")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_collective_over_nccl_is_exact():
    """The NCCL path: same buckets, CUDA buffers; sender on GPU 0, engine on GPU 1 (NCCL
    wants one device per rank). Runs only where the GPUs are."""
    sender, engine = _group(
        TransportSettings("collective", backend="nccl", bucket_mb=0.1, timeout_s=60), 1
    )
    sent = {k: v.to("cuda:0") for k, v in _weights(torch.bfloat16).items()}

    def on_gpu1(*args):
        torch.cuda.set_device(1)
        _receive_all(*args)

    _push_one(sender, engine, sent, 1, receive=on_gpu1)


def test_collective_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="'gloo' \\(CPU\\) or 'nccl' \\(GPU\\)"):
        make_transport(TransportSettings("collective", backend="mpi"))


@pytest.mark.parametrize("streamed", [False, True])
def test_collective_sender_fingerprints_what_it_packs(streamed):
    # The proof of delivery's learner side, fused into the bucket copy
    # (weightsync/verify.copy_fingerprint): the same fingerprints as a separate pass,
    # and the engines still get every byte.
    sender, engine = _group(TransportSettings("collective", bucket_mb=0.1, timeout_s=30), 1)
    sent = _weights(torch.bfloat16)
    sent["big"] = torch.randn(1100, 1000).to(torch.bfloat16)  # 2.2 MB: 3 hash chunks
    del sent["lm_head.weight"]
    seen: dict[str, str] = {}
    out = {}
    if streamed:
        layout = [(n, "bfloat16", tuple(t.shape)) for n, t in sent.items()]
        handle = sender.stream_handle(layout, version=2)
        rx = threading.Thread(target=_receive_all, args=(engine, handle, out, 0))
        rx.start()
        sender.send_stream(iter(sent.items()), handle, seen=seen)
    else:
        handle = sender.send(sent, version=2, seen=seen)
        rx = threading.Thread(target=_receive_all, args=(engine, handle, out, 0))
        rx.start()
        sender.finish(handle)
    rx.join()
    assert seen == fingerprints(sent.items())
    got = out[0]
    for k, v in sent.items():
        assert torch.equal(got[k].view(torch.int16), v.view(torch.int16))
