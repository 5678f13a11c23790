"""Reading a recipe: YAML → `--set` overrides → the validated `Recipe`, and pydantic's
errors rewritten as one line per key path with its fix. The models themselves are in
`posttrain.config`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..config import Recipe, RecipeError
from ..config.yamlfile import parse_yaml, read_yaml

# Union tags pydantic puts into error locations: data variants right after `train`,
# `prompts` or a mixture's list index, reward types right after a list index. Only there
# are they dropped (`format` is also a real key of file data).
_DATA_TAGS = {"generator", "reasoning_gym", "file", "mixture"}
_REWARD_TAGS = {
    "math",
    "length",
    "format",
    "code",
    "python",
    "http",
    "reward_model",
    "judge",
    "reasoning_gym",
}


def _key_path(loc: tuple) -> str:
    keep, prev = [], None
    for p in loc:
        data_tag = p in _DATA_TAGS and (prev in ("train", "prompts") or isinstance(prev, int))
        tag = data_tag or (isinstance(prev, int) and p in _REWARD_TAGS)
        if not tag and not str(p).startswith("function-after"):
            keep.append(str(p))
        prev = p
    return ".".join(keep)


def _set_by(loc: str, overrides: list[str]) -> str:
    """'; from --set K=V' for the last override whose key is `loc`, above it or below
    it, else ''."""
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if loc == key or loc.startswith(key + ".") or key.startswith(loc + "."):
            return f"; from --set {item}"
    return ""


def format_errors(
    err: ValidationError,
    source: str,
    what: str = "the recipe",
    overrides: list[str] | None = None,
) -> str:
    """pydantic's errors as one line a key: its path in the recipe, what is wrong and the
    fix; a key a `--set` of `overrides` gave is named with that `--set`."""
    lines = [f"{source}: {err.error_count()} problem(s) in {what}:"]
    for e in err.errors():
        loc = _key_path(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "union_tag_invalid":  # e.g. rewards.0.type: mathh
            ctx = e["ctx"]
            loc = ".".join(filter(None, (loc, str(ctx["discriminator"]).strip("'"))))
            msg = (
                f"unknown {ctx['tag']!r}; use one of {ctx['expected_tags']} "
                "(see `posttrain schema`)"
            )
        elif e["type"] == "extra_forbidden" and loc == "data.train.path":
            # a generator's block with a path added to it (`--set data.train.path=...`)
            msg = (
                "unknown key in a generator's data.train block; to train on a file "
                "replace the block: --set 'data.train={path: FILE.jsonl}'"
            )
        elif e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or fix its spelling (see `posttrain schema`)"
        elif e["type"] == "bool_for_number":  # raised by the block: name the key itself
            loc = ".".join(filter(None, (loc, e["ctx"]["key"]))) + e["ctx"]["where"]
            msg = msg.partition(": ")[2]
        elif e["type"] == "missing":
            msg = "required key is missing; add it (see `posttrain schema`)"
        elif "input" in e and not isinstance(e["input"], dict | list):
            msg = f"{msg} (got {e['input']!r})"
        msg += _set_by(loc, overrides or []) if loc else ""
        lines.append(f"  - {loc}: {msg}" if loc else f"  - {msg}")
    return "\n".join(lines)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node: Any = tree
    for i, k in enumerate(keys[:-1]):
        if isinstance(node, list) and k.isdigit() and int(k) < len(node):
            node = node[int(k)]
            continue
        if not isinstance(node, dict):
            raise RecipeError(
                f"--set {dotted}: '{'.'.join(keys[:i])}' is not a mapping; check the key path"
            )
        node = node.setdefault(k, {})
    last = keys[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise RecipeError(f"--set {dotted}: parent is not a mapping; check the key path")


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides (value parsed as YAML) to a raw recipe tree.

    Raises:
        RecipeError: an override without '=' or whose path crosses a non-mapping.
    """
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not all(key.split(".")):  # no '=', or an empty key or key part
            raise RecipeError(f"--set {item!r}: expected key.path=value, e.g. train.steps=2")
        try:
            value = parse_yaml(raw, f"--set {item!r}")
        except RecipeError as e:
            raise RecipeError(
                f"{e}; quote strings, e.g. --set 'model.path=\"/my/model\"'"
            ) from None
        _set_path(tree, key.strip(), value)
    return tree


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe YAML.

    Relative data paths are resolved against the recipe file's folder.

    Raises:
        RecipeError: missing or unreadable file, YAML syntax error, or a schema violation;
            the message names the file and each offending key path with its fix.
    """
    path = Path(path)
    if path.is_dir():
        hint = (
            " (a run folder: its recipe is RUN_DIR/recipe.yaml)"
            if (path / "recipe.yaml").is_file()
            else ""
        )
        raise RecipeError(
            f"{path}: is a folder, not a recipe file{hint}; give the path to a .yaml recipe"
        )
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found; give the path to a .yaml recipe")
    tree = read_yaml(path)
    if not isinstance(tree, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of keys (name, algorithm, model, ...)")
    tree = apply_overrides(tree, overrides or [])
    _resolve_data_paths(tree, path.parent)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise RecipeError(format_errors(e, str(path), overrides=overrides)) from None


def _resolve_data_paths(tree: dict[str, Any], folder: Path) -> None:
    """Make the `path` of data.train, data.heldout, eval.prompts and their mixtures'
    entries absolute, relative ones read from `folder` (the recipe's)."""
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    train, pairs = data.get("train"), data.get("heldout")
    held_out = tree.get("eval", {}).get("prompts") if isinstance(tree.get("eval"), dict) else None
    blocks = [train, held_out, pairs]
    for block in (train, held_out, pairs):
        if isinstance(block, dict) and isinstance(block.get("mixture"), list):
            blocks += block["mixture"]
    for block in blocks:
        if isinstance(block, dict) and isinstance(block.get("path"), str):
            p = Path(block["path"]).expanduser()
            if p.is_absolute():  # `~/data/x.jsonl` included: expanded above
                block["path"] = str(p)
            else:
                try:
                    block["path"] = str((folder / p).resolve())
                except (OSError, RuntimeError):  # a symlink loop: preflight names it
                    block["path"] = str((folder / p).absolute())


def dump_recipe(recipe: Recipe) -> str:
    """`recipe` as YAML that `load_recipe` reads back to an equal recipe: the keys the
    recipe set (and its overrides), not every default (a filled-in default such as
    `model.adapter.alpha` beside `type: none` would no longer validate)."""
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude_unset=True), sort_keys=False)
