"""`algorithms.tinker`: the loss spec errors name the wire field (without the service),
and a `SessionBatch` whose tensors disagree is refused naming the tensor."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.tinker import LossSpecError, SessionBatch, check_loss, stack_batches


def test_loss_spec_error_names_the_field() -> None:
    with pytest.raises(LossSpecError) as e:
        names = {"target_tokens", "logprobs", "advantages"}
        check_loss("ppo", {"clip_low_threshold": float("nan")}, names)
    assert e.value.field == "loss_fn_config.clip_low_threshold"
    assert isinstance(e.value, ValueError)


def _batch(**change: torch.Tensor) -> SessionBatch:
    ids = torch.zeros(2, 3, dtype=torch.long)
    parts = {"input_ids": ids, "attention_mask": torch.ones(2, 3), "target_tokens": ids.clone()}
    parts.update({k: v for k, v in change.items() if k in parts})
    inputs = {k: v for k, v in change.items() if k not in parts}
    return SessionBatch(**parts, inputs=inputs)


def test_session_batch_check_names_the_tensor() -> None:
    _batch(weights=torch.ones(2, 3)).check()
    with pytest.raises(ValueError, match="inputs.weights: shape"):
        _batch(weights=torch.ones(2, 4)).check()
    with pytest.raises(ValueError, match="inputs.advantages: holds NaN"):
        _batch(advantages=torch.full((2, 3), float("nan"))).check()
    with pytest.raises(ValueError, match="target_tokens: dtype"):
        _batch(target_tokens=torch.zeros(2, 3)).check()


def test_stack_batches_pads_right_and_fills_with_rows_that_count_nothing() -> None:
    a = SessionBatch(
        torch.tensor([[1, 2, 3]]),
        torch.ones(1, 3),
        torch.tensor([[2, 3, 4]]),
        {"weights": torch.tensor([[0.5, 1.0, 1.0]])},
    )
    b = SessionBatch(
        torch.tensor([[7, 8]]),
        torch.ones(1, 2),
        torch.tensor([[8, 9]]),
        {"advantages": torch.tensor([[2.0, -1.0]])},
    )
    out = stack_batches([a, b], rows=4)
    out.check()
    assert out.input_ids.tolist() == [[1, 2, 3], [7, 8, 0], [0, 0, 0], [0, 0, 0]]
    assert out.target_tokens.tolist() == [[2, 3, 4], [8, 9, 0], [0, 0, 0], [0, 0, 0]]
    # filler rows attend to their first position only (no NaN attention), weigh nothing
    assert out.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]]
    assert out.inputs["weights"].tolist() == [[0.5, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert out.inputs["advantages"].tolist() == [[0, 0, 0], [2, -1, 0], [0, 0, 0], [0, 0, 0]]
    empty = stack_batches([], rows=1, names=("weights",))  # a rank given no datum
    assert empty.attention_mask.tolist() == [[1.0]]
    assert empty.inputs["weights"].tolist() == [[0.0]]  # its filler row weighs nothing
