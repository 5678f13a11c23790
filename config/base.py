"""Shared base of every recipe block, and the error a recipe that cannot run raises."""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

_NUMBERS = (int, float)


class Strict(BaseModel):
    """Base for every recipe block: unknown keys are errors, not silently ignored, and so
    are non-finite numbers (`inf`, `nan` in any float field: a learning rate, a
    temperature, a weight, an over-sampling factor) and booleans given for numbers
    (pydantic reads `true` as 1 in an int or float field: `max_token_staleness: true`
    would mean 1 token), also inside lists and mappings of numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data: Any) -> Any:
        # before pydantic's lax mode reads true as 1; a field validator cannot do it
        # (pydantic refuses one on a union's discriminator field)
        if not isinstance(data, dict):
            return data
        by_key = {f.alias or name: f for name, f in cls.model_fields.items()}
        for key, value in data.items():
            field = by_key.get(key)
            where = None if field is None else _bool_for_number(_members(field.annotation), value)
            if where is not None:
                raise PydanticCustomError(
                    "bool_for_number",
                    "{key}{where}: a boolean (true/false) where a number goes; write "
                    "the number itself (e.g. 1 or 0.5)",
                    {"key": key, "where": where},
                )
        return data


def _members(ann: Any) -> list[Any]:
    """The alternatives of a type hint: `float | None` -> [float, NoneType]; Annotated
    unwrapped."""
    if get_origin(ann) is Annotated:
        return _members(get_args(ann)[0])
    if get_origin(ann) in (Union, types.UnionType):
        return [m for a in get_args(ann) for m in _members(a)]
    return [ann]


def _takes_bool(members: list[Any]) -> bool:
    return any(
        m in (bool, Any, object)
        or (get_origin(m) is Literal and any(isinstance(a, bool) for a in get_args(m)))
        for m in members
    )


def _takes_number(members: list[Any]) -> bool:
    return any(
        (isinstance(m, type) and issubclass(m, _NUMBERS) and m is not bool)
        or (get_origin(m) is Literal and any(isinstance(a, _NUMBERS) for a in get_args(m)))
        for m in members
    )


def _bool_for_number(members: list[Any], value: Any) -> str | None:
    """Where in `value` a boolean stands for a number the hint's `members` take: '' for
    `value` itself, '[I]' / '[K]' inside lists and mappings (nested: '[0][a]'); None
    when nowhere. Sub-models (dicts for a Strict block) check themselves."""
    if isinstance(value, bool):
        return "" if _takes_number(members) and not _takes_bool(members) else None
    if Any in members or object in members:
        return None
    origins = {get_origin(m): m for m in members}
    if isinstance(value, list | tuple):
        inner = [
            a
            for m in members
            if get_origin(m) in (list, tuple, set, frozenset, Sequence)
            for a in get_args(m)
            if a is not Ellipsis
        ]
        items: Any = enumerate(value)
    elif isinstance(value, dict) and (dict in origins or Mapping in origins):
        inner = [get_args(m)[1] for m in members if get_origin(m) in (dict, Mapping)]
        items = value.items()
    else:
        return None
    hint = [m for a in inner for m in _members(a)]
    for key, item in items:
        where = _bool_for_number(hint, item)
        if where is not None:
            return f"[{key}]{where}"
    return None


class RecipeError(Exception):
    """A recipe that cannot run; the message names the file, the key path and the fix."""
