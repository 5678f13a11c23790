"""Two sessions of `posttrain serve` training at once through the SDK: each adapter
changes only by its own updates, and the interleaving changes nothing (the same seed
and data give bit-identical adapters with or without a neighbour training)."""

from __future__ import annotations

from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.service.conftest import TOKEN  # noqa: E402


def _data(tok, texts: list[str]) -> list[types.Datum]:  # noqa: ANN001
    out = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return out


def _step(tc, data) -> None:  # noqa: ANN001
    fb = tc.forward_backward(data, "cross_entropy")
    op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    fb.result()
    op.result()


def test_two_sessions_are_isolated(served: Any) -> None:
    a = tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
    b = tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
    ta = a.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    tb = b.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()
    stack = served.state.stack

    class M:
        def __init__(self, mid: str) -> None:
            self.mid = mid

        def checksum(self) -> str:
            return stack.checksum(self.mid)

    ma, mb = M(ta.model_id), M(tb.model_id)
    tok = ta.get_tokenizer()
    da, db = _data(tok, ["abcabcabc"] * 4), _data(tok, ["xyz xyz xyz"] * 4)
    a0, b0 = ma.checksum(), mb.checksum()
    a_loss0 = ta.forward(da, "cross_entropy").result().metrics["loss:sum"]
    b_loss0 = tb.forward(db, "cross_entropy").result().metrics["loss:sum"]

    _step(ta, da)  # only A trains
    a1 = ma.checksum()
    assert a1 != a0 and mb.checksum() == b0

    # interleaved: A's and B's gradients are pending at the same time
    fa = ta.forward_backward(da, "cross_entropy")
    fb = tb.forward_backward(db, "cross_entropy")
    oa = ta.optim_step(types.AdamParams(learning_rate=1e-2))
    ob = tb.optim_step(types.AdamParams(learning_rate=1e-2))
    for f in (fa, fb, oa, ob):
        f.result()
    assert ma.checksum() not in (a0, a1) and mb.checksum() != b0

    # A solo in a third session, same seed and data: bit-identical to A beside B
    c = tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
    tcc = c.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    assert M(tcc.model_id).checksum() == a0
    _step(tcc, da)
    _step(tcc, da)
    assert M(tcc.model_id).checksum() == ma.checksum()

    # both learn
    assert ta.forward(da, "cross_entropy").result().metrics["loss:sum"] < a_loss0
    assert tb.forward(db, "cross_entropy").result().metrics["loss:sum"] < b_loss0
    for client in (a, b, c):  # finished, so their heartbeats stop with the test
        client.close("success").result(timeout=30)
