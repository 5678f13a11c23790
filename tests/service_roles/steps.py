"""What the tests of the service on its roles train: three short data of the tiny
model's vocabulary and one SDK step on them (forward_backward, then Adam)."""

from __future__ import annotations

from typing import Any

from tinker import types

DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints([4, 5, 6, 7, 8][: n + 2]),
        loss_fn_inputs={"target_tokens": [5, 6, 7, 8, 9][: n + 2], "weights": [1.0] * (n + 2)},
    )
    for n in range(3)
]


def step(tc: Any) -> None:
    """One forward_backward on `DATA` and an optim_step (lr 1e-2) of training client `tc`."""
    fb = tc.forward_backward(DATA, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    fb.result()
