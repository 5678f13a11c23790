"""Checks of training requests before they are queued: a bad one is a `UserError`
naming the datum and field (a 400), so nothing reaches the learner that it cannot run
exactly."""

from __future__ import annotations

import math
from typing import Any

from .errors import UserError, check
from .losses import check_loss
from .wire import WireDatum

# The SDK's AdamParams and their defaults (tinker 0.38.0 `types.AdamParams`).
ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


def check_data(
    data: list[WireDatum], loss_fn: str, config: dict[str, float], vocab: int, context: int
) -> dict[str, float]:
    """Validate a `forward_backward` batch; returns the loss config with its defaults.

    Raises:
        UserError: no data, a datum longer than the model's context or empty, a token id
            outside the vocabulary, a loss input of the wrong shape, an unserved loss or
            config key (each named: `data[i].loss_fn_inputs.<name>`).
    """
    if not data:
        raise UserError("data", "is empty; send at least one datum")
    full: dict[str, float] = {}
    for i, d in enumerate(data):
        full = check_loss(loss_fn, config, set(d.inputs))
        n = d.tokens.size
        if n == 0 or n > context:
            raise UserError(
                f"data[{i}].model_input", f"has {n} tokens; the model takes 1 to {context}"
            )
        bad = d.tokens[(d.tokens < 0) | (d.tokens >= vocab)]
        if bad.size:
            raise UserError(
                f"data[{i}].model_input",
                f"token id {int(bad[0])} is outside the vocabulary [0, {vocab})",
            )
        for name in sorted(d.inputs, key=lambda k: (k != "target_tokens", k)):
            arr = d.inputs[name]
            if arr.shape != (n,):
                raise UserError(
                    f"data[{i}].loss_fn_inputs.{name}",
                    f"shape {list(arr.shape)} must be [{n}], one per model_input token",
                )
        t = d.inputs["target_tokens"]
        if ((t < 0) | (t >= vocab)).any():
            raise UserError(
                f"data[{i}].loss_fn_inputs.target_tokens", f"token ids must lie in [0, {vocab})"
            )
    return full


def adam_params(params: Any) -> dict[str, float]:
    """An `optim_step` body's `adam_params` with defaults filled.

    Raises:
        UserError: not an object; an unknown key; a value that is not a finite number;
            a negative learning rate, weight decay or clip norm; beta1 or beta2 outside
            [0, 1) (AdamW's moments would not decay); eps ≤ 0 (a zero second moment would
            divide by zero).
    """
    check(isinstance(params, dict), "adam_params", "needed (this service runs Adam)")
    unknown = sorted(set(params) - set(ADAM_DEFAULTS))
    check(
        not unknown,
        f"adam_params.{unknown[0] if unknown else ''}",
        f"is not an Adam parameter; use {sorted(ADAM_DEFAULTS)}",
    )
    values = {}
    for k, d in ADAM_DEFAULTS.items():
        v = params.get(k, d)
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        check(ok, f"adam_params.{k}", f"must be a finite number, got {v!r}")
        values[k] = float(v)
    for k in ("learning_rate", "weight_decay", "grad_clip_norm"):
        check(values[k] >= 0, f"adam_params.{k}", f"must be ≥ 0, got {values[k]}")
    for k in ("beta1", "beta2"):
        check(0 <= values[k] < 1, f"adam_params.{k}", f"must be in [0, 1), got {values[k]}")
    check(values["eps"] > 0, "adam_params.eps", f"must be > 0, got {values['eps']}")
    return values
