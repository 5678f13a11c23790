"""Shared base of every recipe block, and the error a recipe that cannot run raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for every recipe block: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RecipeError(Exception):
    """A recipe that cannot run; the message names the file, the key path and the fix."""
