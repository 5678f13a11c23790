"""Shared base of every recipe block, and the error a recipe that cannot run raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for every recipe block: unknown keys are errors, not silently ignored, and so
    are non-finite numbers (`inf`, `nan` in any float field: a learning rate, a
    temperature, a weight, an over-sampling factor)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RecipeError(Exception):
    """A recipe that cannot run; the message names the file, the key path and the fix."""
