"""Several sessions in one learner forward (`sessions_forward_backward`, slot blocks with
per-row masks, learner/session_slot.py), on 2 gloo ranks: each session's logprobs,
gradient norms and trained adapter equal those of the same session run alone (to float32
rounding: the batch's shape changes the kernels' summation order), in either block."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from posttrain.learner.settings import SessionSettings
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from posttrain.weightsync import TransportSettings
from tests.learner.ranks import run_ranks
from tests.learner.test_sessions import ADAM, make_batch, shard

CE, IS = "cross_entropy", "importance_sampling"


def _pair(w: LearnerWorker, suffix: str) -> None:
    w.open_session("a" + suffix, 2, 1, True, True)
    w.open_session("b" + suffix, 4, 2, True, False)


def _rank_main(rank, world, model_path, folder, checkpointing, port, queue):
    settings = LearnerSettings(
        model_path=str(model_path),
        compute_dtype="float32",
        gradient_checkpointing=checkpointing,
        transport=TransportSettings(type="filesystem", directory=f"{folder}/push"),
        sessions=SessionSettings(max_rank=4, max_sessions=8, batch_sessions=2),
    )
    w = LearnerWorker(rank, world, settings, threads=1)
    w.setup(port)
    xs = [shard(make_batch(i), rank, world) for i in range(2)]
    ys = [shard(make_batch(10 + i, rl=True, width=7), rank, world) for i in range(2)]
    _pair(w, "")
    _pair(w, "2")
    out = {"batched": [], "alone": [], "norms": [], "alone_norms": []}
    first = w.sessions_forward_backward([("a", xs[0], CE, {}), ("b", ys[0], IS, {})], True)
    out["batched"].append([r["logprobs"] for r in first])
    out["norms"] += [w.session_optim_step(s, ADAM)["grad_norm"] for s in "ab"]
    # blocks swap: b now runs in block 0, a in block 1; both adapters are non-zero now
    second = w.sessions_forward_backward([("b", ys[1], IS, {}), ("a", xs[1], CE, {})], True)
    out["batched"].append([r["logprobs"] for r in second])
    out["norms"] += [w.session_optim_step(s, ADAM)["grad_norm"] for s in "ba"]
    for sid, batches, loss in (("a2", xs, CE), ("b2", ys, IS)):
        for b in batches:
            got = w.session_forward_backward(sid, b, loss, {}, True)
            out["alone"].append(got["logprobs"])
            out["alone_norms"].append(w.session_optim_step(sid, ADAM)["grad_norm"])
    for sid in ("a", "b", "a2", "b2"):
        w.save_session(sid, f"{folder}/{sid}", optimizer=True)
    errors = []
    for items in ([("a", xs[0], CE, {})] * 2, [(s, xs[0], CE, {}) for s in ("a", "a2", "b2")]):
        try:
            w.sessions_forward_backward(items, True)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    if rank == 0:
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put(buf.getvalue())
    w.close()


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "checkpointing"])
def run(request, tiny_model, tmp_path_factory):
    """Also under gradient checkpointing: the recomputed forward must see the masks."""
    folder = tmp_path_factory.mktemp("batched")
    return folder, run_ranks(_rank_main, 2, tiny_model, str(folder), request.param)


def test_sessions_in_one_forward_equal_each_alone(run):
    folder, r = run
    a0, b0 = r["batched"][0]
    b1, a1 = r["batched"][1]
    alone_a0, alone_a1, alone_b0, alone_b1 = r["alone"]
    for got, want in ((a0, alone_a0), (a1, alone_a1), (b0, alone_b0), (b1, alone_b1)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    a_n0, b_n0, b_n1, a_n1 = r["norms"]
    assert [a_n0, a_n1, b_n0, b_n1] == pytest.approx(r["alone_norms"], rel=1e-5)


def test_each_batched_session_trains_only_its_own_adapter_and_adamw(run):
    from safetensors.torch import load_file

    folder, _ = run
    for sid in ("a", "b"):
        for name in ("adapter_model.safetensors", "optimizer.safetensors"):
            got = load_file(str(Path(folder) / sid / name))
            want = load_file(str(Path(folder) / f"{sid}2" / name))
            assert got.keys() == want.keys()
            for k in got:
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)


def test_batch_limits_are_refused(run):
    _, r = run
    twice, three = r["errors"]
    assert "a session twice" in twice
    assert "sessions.batch_sessions (2)" in three
