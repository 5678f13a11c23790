"""The served losses: the math lives in `algorithms/tinker.py` (both the service and the
learner import it); here only its errors become the service's `UserError` (a 400 naming
the field)."""

from __future__ import annotations

from ..algorithms import tinker
from ..algorithms.tinker import LOSSES, OPTIONAL_INPUTS, RL_INPUTS, LossResult, tinker_loss
from .errors import UserError

__all__ = ["LOSSES", "OPTIONAL_INPUTS", "RL_INPUTS", "LossResult", "check_loss", "tinker_loss"]


def check_loss(name: str, config: dict[str, float], input_names: set[str]) -> dict[str, float]:
    """`algorithms.tinker.check_loss`, raising `UserError` naming the field."""
    try:
        return tinker.check_loss(name, config, input_names)
    except tinker.LossSpecError as e:
        raise UserError(e.field, e.message) from e
