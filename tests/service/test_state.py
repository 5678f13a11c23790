"""Training state through the SDK: save_state / load_state_with_optimizer restore the
adapter bit for bit, load_state starts AdamW afresh, a state opens a new training
client; full fine-tuning is refused on the shared base; samplers live as long as the
root."""

from __future__ import annotations

from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([4, 5, 6, 7]),
    loss_fn_inputs={"target_tokens": [5, 6, 7, 8], "weights": [1.0] * 4},
)


def _step(tc) -> None:  # noqa: ANN001
    fb = tc.forward_backward([DATUM], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    fb.result()


def test_save_then_load_restores_the_adapter(served: Any, client) -> None:  # noqa: ANN001
    tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=3).result()
    checksum = lambda: served.state.stack.checksum(tc.model_id)  # noqa: E731
    _step(tc)
    saved = checksum()
    path = tc.save_state("after-one").result().path
    assert path == f"tinker://{tc.model_id}/weights/after-one"
    _step(tc)
    assert checksum() != saved
    tc.load_state_with_optimizer(path).result()
    assert checksum() == saved
    with pytest.raises(tinker.BadRequestError) as e:
        tc.load_state(f"tinker://{tc.model_id}/weights/missing").result()
    assert e.value.body["field"] == "path"


def test_full_fine_tuning_is_refused_on_the_shared_base(client) -> None:  # noqa: ANN001
    """The 409 says `x-should-retry: false`: without it the SDK re-sent the request with
    backoff for about a minute (58 s in the suite) before the user saw the refusal."""
    with pytest.raises(tinker.APIStatusError) as e:
        client.create_lora_training_client(
            base_model="tiny", rank=1, user_metadata={"full_finetune": "true"}
        ).result()
    assert e.value.status_code == 409
    assert e.value.body["field"] == "user_metadata.full_finetune"
    assert e.value.response.headers["x-should-retry"] == "false"


def test_load_state_without_optimizer_starts_adam_afresh(served: Any, client) -> None:  # noqa: ANN001
    """Issue 47: load_state kept the live AdamW moments (the next step then differed from
    a fresh optimizer's by up to 0.105 in logprob). A state loaded into a used model and
    the same state in a new model (from_state) take the same next step, bit for bit."""
    tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=5).result()
    _step(tc)
    path = tc.save_state("s1").result().path
    for _ in range(3):
        _step(tc)  # moments move on
    tc.load_state(path).result()
    _step(tc)
    fresh = client.create_training_client_from_state(path).result()
    _step(fresh)
    stack = served.state.stack
    assert stack.checksum(fresh.model_id) == stack.checksum(tc.model_id)
    with_opt = client.create_training_client_from_state_with_optimizer(path).result()
    _step(with_opt)
    assert stack.checksum(with_opt.model_id) != stack.checksum(tc.model_id)


def test_named_sampler_weights_open_a_sampling_client(client) -> None:  # noqa: ANN001
    """The cookbook's rl_loop.py path: save_weights_for_sampler(name) then
    ServiceClient.create_sampling_client(model_path=...)."""
    tc = client.create_lora_training_client(base_model="tiny", rank=2).result()
    path = tc.save_weights_for_sampler(name="000000").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/000000"
    sc = client.create_sampling_client(model_path=path)
    seqs = sc.sample(DATUM.model_input, 1, types.SamplingParams(max_tokens=2)).result().sequences
    assert len(seqs) == 1 and len(seqs[0].tokens) == len(seqs[0].logprobs)
    base = client.create_sampling_client(base_model="tiny")
    assert (
        len(
            base.sample(DATUM.model_input, 3, types.SamplingParams(max_tokens=2)).result().sequences
        )
        == 3
    )


def test_a_held_sampler_outlives_later_saves(client) -> None:  # noqa: ANN001
    """Issue 47: a SamplingClient still held 404'd after 8 later saves."""
    tc = client.create_lora_training_client(base_model="tiny", rank=2).result()
    first = tc.save_weights_and_get_sampling_client().result()
    for _ in range(9):
        _step(tc)
        tc.save_weights_and_get_sampling_client().result()
    seqs = first.sample(DATUM.model_input, 1, types.SamplingParams(max_tokens=2)).result()
    assert len(seqs.sequences) == 1
