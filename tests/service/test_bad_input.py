"""Bad requests to `posttrain serve` get a 4xx naming the field, through the SDK and
raw HTTP, and the service keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.service.conftest import TOKEN  # noqa: E402

H = {"X-API-Key": TOKEN}


@pytest.fixture(scope="module")
def tc(client):  # noqa: ANN001, ANN201
    return client.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()


def _datum(ids: list[int], **inputs: list) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=inputs)


GOOD = {"target_tokens": [5, 6, 7], "weights": [1.0, 1.0, 1.0]}
RL = {"target_tokens": [5, 6, 7], "logprobs": [0.0] * 3, "advantages": [1.0] * 3}


@pytest.mark.parametrize(
    ("datum", "loss", "field"),
    [
        (_datum([4, 5, 6], **GOOD), "dro", "loss_fn"),  # the SDK knows it, we don't serve it
        (_datum([4, 5, 10**6], **GOOD), "cross_entropy", "data[0].model_input"),
        (
            _datum([4, 5, 6], target_tokens=[5, 6], weights=[1.0, 1.0]),
            "cross_entropy",
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (
            _datum([4, 5, 6], target_tokens=[5, 6, 99999], weights=[1.0] * 3),
            "cross_entropy",
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (_datum([4, 5, 6], **GOOD), "ppo", "loss_fn_inputs.logprobs"),
        (
            _datum([4] * 600, target_tokens=[5] * 600, weights=[1.0] * 600),
            "cross_entropy",
            "data[0].model_input",
        ),  # the tiny model's context is 512
        (
            _datum([4, 5, 6], **{**RL, "advantages": [float("nan"), 0.0, 0.0]}),
            "importance_sampling",
            "data[0].loss_fn_inputs.advantages",
        ),
        (  # finite as a Python float, inf in the float32 the wire carries
            _datum([4, 5, 6], **{**RL, "advantages": [1e39, 0.0, 0.0]}),
            "importance_sampling",
            "data[0].loss_fn_inputs.advantages",
        ),
    ],
)
def test_bad_forward_backward_names_the_field(tc, datum, loss: str, field: str) -> None:  # noqa: ANN001
    with pytest.raises(tinker.BadRequestError) as e:
        tc.forward_backward([datum], loss).result()
    assert e.value.status_code == 400
    assert e.value.body["field"] == field, e.value.body


def test_bad_config_and_unknown_names(served: Any, tc) -> None:  # noqa: ANN001
    with pytest.raises(tinker.BadRequestError) as e:
        tc.forward_backward([_datum([4, 5, 6], **RL)], "ppo", {"clip_ratio": 0.2}).result()
    assert e.value.body["field"] == "loss_fn_config.clip_ratio"
    post = lambda path, body: httpx.post(served.url + path, json=body, headers=H)  # noqa: E731
    r = post(
        "/api/v1/create_model",
        {"session_id": "nope", "base_model": "tiny", "model_seq_id": 0, "lora_config": {"rank": 2}},
    )
    assert (r.status_code, r.json()["field"]) == (404, "session_id")
    sid = post("/api/v1/create_session", {}).json()["session_id"]
    r = post(
        "/api/v1/create_model",
        {
            "session_id": sid,
            "base_model": "no-such-model",
            "model_seq_id": 0,
            "lora_config": {"rank": 2},
        },
    )
    assert (r.status_code, r.json()["field"]) == (404, "base_model")
    r = post("/api/v1/optim_step", {"model_id": "model-0", "adam_params": {}})
    assert (r.status_code, r.json()["field"]) == (404, "model_id")
    body = f'{{"model_id": "{tc.model_id}", "adam_params": {{"learning_rate": Infinity}}}}'
    r = httpx.post(served.url + "/api/v1/optim_step", content=body, headers=H)
    assert (r.status_code, r.json()["field"]) == (400, "adam_params.learning_rate")
    r = httpx.post(served.url + "/api/v1/create_session", json={})
    assert r.status_code == 401
    r = httpx.post(served.url + "/api/v1/forward_backward", content=b"\xff\x00junk", headers=H)
    assert (r.status_code, r.json()["field"]) == (400, "body")


def test_service_stays_up_after_bad_input(served: Any, tc) -> None:  # noqa: ANN001
    assert httpx.get(served.url + "/api/v1/healthz").json() == {"status": "ok"}
    out = tc.forward([_datum([4, 5, 6], **GOOD)], "cross_entropy").result()
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 3


def test_a_prompt_longer_than_the_context_is_refused(tc) -> None:  # noqa: ANN001
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError) as e:
        sampler.sample(types.ModelInput.from_ints([4] * 512), 1, types.SamplingParams()).result()
    assert e.value.body["field"] == "prompt"


def test_bearer_token_capabilities_and_health(served: Any) -> None:
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    caps = httpx.get(served.url + "/api/v1/get_server_capabilities", headers=bearer)
    assert caps.status_code == 200
    assert caps.json()["supported_models"][0]["model_name"] == "tiny"
    wrong = {"Authorization": "Bearer tml-wrong"}
    r = httpx.get(served.url + "/api/v1/get_server_capabilities", headers=wrong)
    assert (r.status_code, r.json()["field"]) == (401, "X-API-Key")
    assert httpx.get(served.url + "/api/v1/healthz").json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"learning_rate": 1e-3, "beta1": 5.0}, "adam_params.beta1"),  # wrecked the model
        ({"learning_rate": 1e-3, "beta2": 1.5}, "adam_params.beta2"),  # was a 500
        ({"learning_rate": 1e-3, "eps": 0.0}, "adam_params.eps"),  # gave NaN
        ({"learning_rate": 1e-3, "betas": [0.9, 0.9]}, "adam_params.betas"),  # was ignored
        ({"learning_rate": True}, "adam_params.learning_rate"),
    ],
)
def test_adam_parameters_are_checked(served: Any, tc, params: dict, field: str) -> None:  # noqa: ANN001
    """Issue 47: AdamParams were checked only as finite and ≥ 0, unknown keys ignored."""
    r = httpx.post(
        served.url + "/api/v1/optim_step",
        json={"model_id": tc.model_id, "adam_params": params},
        headers=H,
    )
    assert (r.status_code, r.json()["field"]) == (400, field), r.json()


def test_stop_empty_is_served_and_prompt_logprobs_are_refused(tc) -> None:  # noqa: ANN001
    """Issue 47: `stop=[]` (documented by the SDK) was refused; prompt logprobs came back
    as None instead of a refusal."""
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([4, 5])
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, stop=[])).result()
    assert len(out.sequences) == 1
    with pytest.raises(tinker.BadRequestError) as e:
        sampler.compute_logprobs(prompt).result()
    assert e.value.body["field"] == "prompt_logprobs"


def test_only_the_served_base_model_is_loaded(served: Any) -> None:
    """Issue 47: create_model loaded any folder with a config.json, and an unknown
    model's 404 showed the server's absolute path."""
    post = lambda path, body: httpx.post(served.url + path, json=body, headers=H)  # noqa: E731
    sid = post("/api/v1/create_session", {}).json()["session_id"]
    for name in (str(served.state.stack.model_path), "/etc", "no-such-model"):
        r = post(
            "/api/v1/create_model",
            {"session_id": sid, "base_model": name, "model_seq_id": 9, "lora_config": {"rank": 2}},
        )
        assert (r.status_code, r.json()["field"]) == (404, "base_model")
    assert "/" not in r.json()["detail"]  # no path of the server's for a plain name


def test_stop_token_ids_end_samples_on_the_engine(served: Any, tc) -> None:  # noqa: ANN001
    """`stop` as token ids reaches the engine: with every id but a few a stop, each sample
    is one token long and ends with one of them."""
    sampler = tc.save_weights_and_get_sampling_client().result()
    stops = list(range(served.state.stack.vocab))[10:]
    params = types.SamplingParams(max_tokens=8, stop=stops, seed=0)
    out = sampler.sample(types.ModelInput.from_ints([4, 5]), 4, params).result()
    ended = [s for s in out.sequences if s.tokens and s.tokens[-1] in stops]
    assert all(len(s.tokens) <= 8 for s in out.sequences)
    assert len(ended) >= 3  # ids 0-9 may run on; 10+ of vocab stop at once
    assert all(len(s.tokens) == 1 + sum(t < 10 for t in s.tokens[:-1]) for s in ended)
