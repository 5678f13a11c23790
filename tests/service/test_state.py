"""Training state through the SDK: save_state / load_state_with_optimizer restore the
adapter bit for bit; full fine-tuning (asked through user_metadata) trains and samples."""

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
    model = served.state.models[tc.model_id]
    _step(tc)
    saved = model.checksum()
    path = tc.save_state("after-one").result().path
    assert path == f"tinker://{tc.model_id}/weights/after-one"
    _step(tc)
    assert model.checksum() != saved
    tc.load_state_with_optimizer(path).result()
    assert model.checksum() == saved
    with pytest.raises(tinker.BadRequestError) as e:
        tc.load_state(f"tinker://{tc.model_id}/weights/missing").result()
    assert e.value.body["field"] == "path"


def test_full_fine_tuning_trains_and_samples(served: Any, client) -> None:  # noqa: ANN001
    tc = client.create_lora_training_client(
        base_model="tiny", rank=1, user_metadata={"full_finetune": "true"}
    ).result()
    model = served.state.models[tc.model_id]
    assert model.spec.rank is None and tc.get_info().is_lora is False
    before = model.checksum()
    _step(tc)
    assert model.checksum() != before
    seqs = (
        tc.save_weights_and_get_sampling_client()
        .sample(types.ModelInput.from_ints([4, 5]), 2, types.SamplingParams(max_tokens=3))
        .result()
        .sequences
    )
    assert [len(s.logprobs) == len(s.tokens) for s in seqs] == [True, True]


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


def test_old_unnamed_samplers_are_evicted(served: Any, client) -> None:  # noqa: ANN001
    """An RL loop makes a sampler per step; the ninth-newest is gone (404 naming it)."""
    tc = client.create_lora_training_client(base_model="tiny", rank=2).result()
    first = tc.save_weights_and_get_sampling_client().result()
    for _ in range(8):
        tc.save_weights_and_get_sampling_client().result()
    alive = [v for v in served.state.samplers.values() if v.model_id == tc.model_id]
    assert len(alive) == 8
    with pytest.raises(tinker.NotFoundError) as e:
        first.sample(DATUM.model_input, 1, types.SamplingParams(max_tokens=2)).result()
    assert e.value.body["field"] == "sampling_session_id"
