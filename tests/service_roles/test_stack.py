"""`posttrain serve` on the roles: with 2 learner ranks and 1 engine, a forward_backward
runs on both ranks and a sample on the engine with the session's adapter delivered (the
status route says so). (A service killed after step 5 and started again on the same
root: test_kill_restart.py.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from posttrain.service.wire import WireDatum  # noqa: E402
from tests.service.conftest import TOKEN, serve, service_config  # noqa: E402
from tests.service_roles.steps import DATA, step  # noqa: E402


def test_two_ranks_and_an_engine_serve_a_session(tiny_model: Path, tmp_path: Path) -> None:
    s = serve(service_config(tiny_model, learners=2, batch=2), tmp_path / "root")
    try:
        client = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        step(tc)
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(DATA[0].model_input, 2, types.SamplingParams(max_tokens=3)).result()
        assert len(out.sequences) == 2
        st = httpx.get(f"{s.url}/api/v1/status", headers={"X-API-Key": TOKEN}).json()
        roles = st["roles"]
        assert roles["learner_ranks"] == 2 and roles["engines"] == 1
        for rank in ("0", "1"):
            assert roles["learner_verbs"][rank]["forward_backward"] == 1
            assert roles["learner_verbs"][rank]["session_optim_step"] == 1
        assert roles["engine_verbs"]["0"]["sample"] == 1
        (delivered,) = roles["deliveries"].values()  # the proof passed for this adapter
        assert delivered["engines"] == 1
        assert st["models"][tc.model_id]["steps"] == 1
        # two sessions' requests in one learner pass give what each gives alone
        other = client.create_lora_training_client(base_model="tiny", rank=2, seed=5).result()
        step(other)
        wire = [WireDatum(np.array(d.model_input.to_ints()), _inputs(d)) for d in DATA]
        stack = s.state.stack
        items = [
            (tc.model_id, wire, "cross_entropy", {}),
            (other.model_id, wire[:2], "cross_entropy", {}),
        ]
        together = stack.forward_backward_many(items, backward=False)
        for item, (outputs, metrics) in zip(items, together, strict=True):
            alone, alone_metrics = stack.forward_backward(*item, backward=False)
            for a, b in zip(outputs, alone, strict=True):
                np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)
            assert abs(metrics["loss:sum"] - alone_metrics["loss:sum"]) < 1e-4
        client.close("success").result(timeout=30)  # its heartbeat stops with the test
    finally:
        s.stop()


def _inputs(d) -> dict:  # noqa: ANN001
    return {
        k: np.asarray(v.tolist(), np.int64 if k == "target_tokens" else np.float32)
        for k, v in d.loss_fn_inputs.items()
    }


def test_status_of_a_service_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`posttrain status ROOT` reads a service root's registry (no roles needed)."""
    from typer.testing import CliRunner

    from posttrain.recipes.cli import app
    from posttrain.service.registry import ModelRecord, Registry

    reg = Registry(tmp_path)
    reg.sessions = {"s1": ["m1"]}
    reg.models = {"m1": ModelRecord("m1", "s1", "tiny", 4, steps=7, saved="x", saved_steps=5)}
    reg.save()
    out = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "| m1 | s1 | 4 | 7 | 5 |" in out.output and "not running" in out.output
