"""A python reward's source checked without running it: `posttrain validate` must not
execute user code (the reward service imports it when it starts)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any


def python_reward_problem(function: str, spec: Any) -> str | None:
    """What is wrong with `module:attr`'s source, read without running it (validate must
    not execute user code): a syntax error, or no top-level `attr` in it. None when it
    looks right, or when it cannot be told without importing (a package's submodule, a
    compiled module, a `from x import *`)."""
    module, _, attr = function.partition(":")
    if "." in module or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        source = Path(spec.origin).read_bytes()
        tree = ast.parse(source, spec.origin)
    except OSError:
        return None
    except (SyntaxError, ValueError) as e:  # ValueError: null bytes
        line = getattr(e, "lineno", None)
        why = e.msg if isinstance(e, SyntaxError) else str(e)
        return f"{spec.origin}{f' line {line}' if line else ''} does not parse: {why}"
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(a.name == "*" for a in node.names):
                return None
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if (
        attr
        and attr not in names
        and not any(isinstance(n, ast.If | ast.Try | ast.With) for n in tree.body)
    ):
        defined = sorted(n for n in names if not n.startswith("_"))
        return f"{spec.origin} defines no {attr!r} at its top level (it has {defined})"
    return None
