"""Delta pushes (weightsync/delta.py): what an engine rebuilds from a delta is bitwise
what a full push would have given it, on every transport that carries deltas; large
changes fall back to whole tensors or a full push; a delta against another base is
refused; a new learner (resume, restart) and `fresh` start with a full push."""

from __future__ import annotations

import threading

import pytest
import ray
import torch

from posttrain.actors.engine import EngineSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.weightsync import (
    GroupStore,
    PushSource,
    TransportSettings,
    WeightSyncError,
    make_transport,
    publish,
)
from posttrain.weightsync.delta import GAP, IDX, VAL, DeltaReceiver, DeltaSender


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(_bits(a[n]), _bits(b[n])), n


def _steps(dtype, n=4, seed=0):
    """`n` versions of a small state dict; between versions 1% of the elements move
    (one tensor: all of them), plus bit patterns a float compare would miss."""
    g = torch.Generator().manual_seed(seed)
    w = {
        "emb": torch.randn(64, 32, generator=g),
        "norm": torch.randn(32, generator=g),
        "big": torch.randn(100, 100, generator=g),
    }
    out = []
    for v in range(n):
        if v:
            w = {k: t.clone() for k, t in w.items()}
            for k in ("emb", "big"):
                idx = torch.randperm(w[k].numel(), generator=g)[: w[k].numel() // 100]
                w[k].view(-1)[idx] += 0.5
            w["norm"] += 1.0  # every element: sent whole
        d = {k: t.to(dtype) for k, t in w.items()}
        d["emb"].view(-1)[3] = -0.0 if v % 2 else 0.0  # equal as floats, not as bits
        d["big"].view(-1)[7] = float("nan")
        out.append(d)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_then_decode_is_bitwise_a_full_push(dtype):
    sender, receiver = DeltaSender(), DeltaReceiver()
    for v, w in enumerate(_steps(dtype), start=1):
        sent, meta = sender.encode(w, v)
        if v == 1:  # no base yet: full
            assert meta is None and sent.keys() == w.keys()
        else:
            assert meta == {"delta": {"base": v - 1, "names": ["emb", "norm", "big"]}}
            assert set(sent) == {"emb" + GAP, "emb" + VAL, "norm", "big" + GAP, "big" + VAL}
            # 1% of big's 10000 elements (+ the NaN, unchanged): 100 gaps and values
            assert sent["big" + GAP].dtype == torch.int16 and sent["big" + GAP].numel() == 100
            assert sender.last.sent_bytes < 0.5 * sender.last.full_bytes
        receiver.check(meta or {}, v, 0)
        got = dict(receiver.decode(iter(sent.items()), meta or {}, v))
        _same_bits(got, w)


def test_a_large_change_goes_full_and_a_foreign_base_is_refused():
    sender, receiver = DeltaSender(), DeltaReceiver()
    a = {"x": torch.zeros(1000)}
    sender.encode(a, 1)
    list(receiver.decode(iter(a.items()), {}, 1))
    # 40% of the elements changed: 40% * (4 + 4) bytes > half of the tensor's bytes
    b = {"x": torch.zeros(1000)}
    b["x"][:400] = 1.0
    sent, meta = sender.encode(b, 2)
    assert meta is None and sender.last.full_push  # the only tensor went whole: full push
    assert sender.last.changed_fraction == pytest.approx(0.4)
    with pytest.raises(
        WeightSyncError,
        match="rollout engine 3: policy_version 5 arrived as a "
        "delta against policy_version 4, but this engine holds no base",
    ):
        DeltaReceiver().check({"delta": {"base": 4, "names": ["x"]}}, 5, 3)


def test_gaps_of_65536_or_more_travel_as_absolute_indices():
    a = {"x": torch.zeros(200_000, dtype=torch.bfloat16)}
    b = {"x": a["x"].clone()}
    b["x"][[1, 70_000, 199_999]] = torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16)
    sender, receiver = DeltaSender(), DeltaReceiver()
    list(receiver.decode(iter(sender.encode(a, 1)[0].items()), {}, 1))
    sent, meta = sender.encode(b, 2)
    assert sent["x" + IDX].tolist() == [1, 70_000, 199_999] and sent["x" + IDX].dtype == torch.int32
    _same_bits(dict(receiver.decode(iter(sent.items()), meta, 2)), b)
    c = {"x": b["x"].clone()}
    c["x"][[5, 65_540]] = 7.0  # gaps 5 and 65535: uint16 still holds them
    sent, meta = sender.encode(c, 3)
    assert sent["x" + GAP].view(torch.uint16).tolist() == [5, 65_535]
    _same_bits(dict(receiver.decode(iter(sent.items()), meta, 3)), c)


def test_reset_and_a_new_sender_start_full():
    w = _steps(torch.bfloat16, n=2)
    sender = DeltaSender()
    sender.encode(w[0], 1)
    assert sender.encode(w[1], 2)[1] is not None
    sender.reset()  # an engine was replaced: push(fresh=True)
    assert sender.encode(w[1], 3)[1] is None
    assert DeltaSender().encode(w[1], 4)[1] is None  # a resumed learner process


def _receive(transport, receiver, handle):
    receiver.check(handle.meta, handle.version, 0)
    return {
        n: t.clone()
        for n, t in receiver.decode(transport.receive(handle), handle.meta, handle.version)
    }


def _publish(transport, delta, w, v):
    items = list(publish(transport, PushSource(iter(w.items())), v, sender=True, delta=delta))
    return items[0]


@pytest.mark.parametrize("kind", ["object_store", "filesystem"])
def test_delta_equals_full_bitwise_through_the_transport(ray_local, tmp_path, kind):
    t = make_transport(TransportSettings(kind, directory=str(tmp_path / "w")))
    sender, receiver = DeltaSender(), DeltaReceiver()
    for v, w in enumerate(_steps(torch.bfloat16), start=1):
        handle = _publish(t, sender, w, v)
        assert ("delta" in handle.meta) == (v > 1)
        if v > 1:
            assert handle.num_bytes < 0.5 * sum(x.numel() * 2 for x in w.values())
        _same_bits(_receive(t, receiver, handle), w)


def test_delta_equals_full_bitwise_through_the_collective():
    settings = TransportSettings("collective", bucket_mb=0.01, timeout_s=30)
    store = GroupStore(3, 30)
    members = [make_transport(settings) for _ in range(3)]
    joins = [
        threading.Thread(target=m.join_group, args=(store.address, r, 3))
        for r, m in enumerate(members)
    ]
    for j in joins:
        j.start()
    for j in joins:
        j.join()
    sender, receivers = DeltaSender(), [DeltaReceiver(), DeltaReceiver()]
    for v, w in enumerate(_steps(torch.bfloat16), start=1):
        gen = publish(members[0], PushSource(iter(w.items())), v, sender=True, delta=sender)
        handle = next(gen)
        out = {}

        def run(i, handle=handle, out=out):
            out[i] = _receive(members[i + 1], receivers[i], handle)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        list(gen)  # the sender's side ends once delivered
        for th in threads:
            th.join()
        for i in range(2):
            _same_bits(out[i], w)
    for m in members:
        m.close()


def test_hf_engine_after_deltas_holds_what_full_pushes_give(tiny_model, tmp_path):
    # Two workers, one fed deltas and one full pushes, end bitwise equal; a new sender
    # (a resumed learner) starts with a full push the delta worker takes.
    from transformers import AutoModelForCausalLM

    engine = EngineSettings("hf", str(tiny_model), "bfloat16")
    d_set = TransportSettings("filesystem", directory=str(tmp_path / "d"), delta=True)
    f_set = TransportSettings("filesystem", directory=str(tmp_path / "f"))
    wd, wf = RolloutWorker(0, engine, d_set, 1), RolloutWorker(1, engine, f_set, 1)
    td, tf = make_transport(d_set), make_transport(f_set)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    base.pop("lm_head.weight")
    g = torch.Generator().manual_seed(3)
    sender = DeltaSender()
    for v in range(1, 5):
        if v == 4:
            sender = DeltaSender()  # resumed learner: no base, so a full push
        for x in base.values():  # an optimizer step: a few bf16 elements move
            x.add_(
                1e-3 * torch.randn(x.shape, generator=g) * (torch.rand(x.shape, generator=g) < 0.05)
            )
        w = {k: x.to(torch.bfloat16) for k, x in base.items()}
        hd = _publish(td, sender, w, v)
        assert ("delta" in hd.meta) == (v in (2, 3))
        assert wd.update_weights(hd) == v and wf.update_weights(_publish(tf, None, w, v)) == v
        held_d, held_f = wd.engine.named_weights(), wf.engine.named_weights()
        _same_bits({k: held_d[k] for k in w}, {k: held_f[k] for k in w})
        _same_bits({k: held_d[k] for k in w}, w)


def test_an_engine_replacement_and_a_retried_push_send_whole_tensors(monkeypatch):
    # The new engine holds no base, and a failed delta may have left engines
    # part-updated: both pushes go out fresh (the learner's delta state reset).
    from types import SimpleNamespace

    from posttrain.recipes import controller
    from posttrain.weightsync import WeightHandle

    calls, failing = [], [True]

    def fake_push(learners, engines, version, timeout_s, full=False, fresh=False):
        calls.append((version, fresh))
        if failing.pop() if failing else False:
            raise WeightSyncError("rollout engine 0: loading policy_version 7 failed")
        return WeightHandle(version, None, 10)

    monkeypatch.setattr(controller, "push", fake_push)
    new = SimpleNamespace(health=SimpleNamespace(remote=lambda: None))
    monkeypatch.setattr(controller, "start_rollout_worker", lambda spec, i, opts: new)
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    monkeypatch.setattr(ray, "get", lambda ref: None)
    recipe = SimpleNamespace(
        weight_sync=SimpleNamespace(timeout_s=5),
        model=SimpleNamespace(adapter=SimpleNamespace(type="none")),
    )
    roles = SimpleNamespace(
        learners=[],
        rollout=["old0", "old1"],
        group=None,
        placement=SimpleNamespace(rollout=[{}, {}]),
        specs=SimpleNamespace(rollout=SimpleNamespace(transport=None)),
        counters=SimpleNamespace(policy_version=6, rollout_restarts=0),
    )
    controller.push_weights(roles, recipe, 7)  # fails once, retried fresh
    assert calls == [(7, False), (7, True)]
    calls.clear()
    controller.replace_rollout_worker(roles, recipe, 1)
    assert calls == [(7, True)] and roles.rollout[1] is new


def test_adapter_pushes_as_deltas_leave_the_engine_serving_the_learners_adapter(
    tiny_model, tmp_path
):
    from peft import get_peft_model_state_dict

    from tests.weightsync.test_verify import _lora

    adapter, config = _lora(tiny_model)
    settings = TransportSettings("filesystem", directory=str(tmp_path / "a"), delta=True)
    w = RolloutWorker(0, EngineSettings("hf", str(tiny_model), "float32", lora_rank=8), settings, 1)
    t, sender = make_transport(settings), DeltaSender()
    g = torch.Generator().manual_seed(5)
    for v in range(1, 4):
        adapter = {
            k: x + 1e-3 * (torch.rand(x.shape, generator=g) < 0.02) for k, x in adapter.items()
        }
        source = PushSource(iter(adapter.items()), None, {"adapter_config": config})
        handle = list(publish(t, source, v, sender=True, verify=True, delta=sender))[0]
        assert ("delta" in handle.meta) == (v > 1)
        assert w.update_weights(handle) == v and w.engine.active_adapter() == v
        _same_bits(dict(get_peft_model_state_dict(w.engine.model)), adapter)
