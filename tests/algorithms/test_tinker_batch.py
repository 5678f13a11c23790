"""`algorithms.tinker`: the loss spec errors name the wire field (without the service),
and a `SessionBatch` whose tensors disagree is refused naming the tensor."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.tinker import LossSpecError, SessionBatch, check_loss


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
