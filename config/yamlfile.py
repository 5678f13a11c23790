"""Reading a user's YAML file (a recipe, a service or reward-server config, a rewards
list) exactly or not at all: UTF-8 only, no key given twice in one mapping (YAML's
loaders keep the last one silently), errors that name the file and line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .base import RecipeError


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a mapping with a key given twice."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} is given twice (lines {seen[key]} and {line}); YAML would keep "
                "only the last one: remove or merge one of them",
                key_node.start_mark,
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def parse_yaml(text: str, source: str) -> Any:
    """`text` parsed as YAML with unique keys; `source` names it in errors.

    Raises:
        RecipeError: a syntax error or a key given twice, with `source` and the line.
    """
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeError(f"{source}: not valid YAML{at}: {problem}") from None


def read_yaml(path: str | Path, source: str | None = None) -> Any:
    """The YAML file `path`, decoded as UTF-8, parsed with unique keys.

    Args:
        source: how errors name the file (default: the path).

    Raises:
        RecipeError: the file cannot be read, is not UTF-8 (the line of the first bad
            byte named), is not YAML, or gives a key twice.
    """
    source = source or str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise RecipeError(f"{source}: cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise RecipeError(
            f"{source}: not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}); save it as UTF-8"
        ) from None
    return parse_yaml(text, source)
