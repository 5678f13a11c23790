"""Size ceilings that only fall: no package file over 400 lines and no function or method
over 80, except the ones listed below at their size when the rule came in. A listed file
or function may shrink, and then its ceiling must come down to its new size (or the entry
goes, once it is within the rule), so nothing grows back into the room it left.

To update: a failure prints the line to write in `FILE_CEILINGS` or `FUNCTION_CEILINGS`.
Lines are `len(text.splitlines())`; a function's size is `end_lineno - lineno + 1` of its
`def` (decorators not counted), named `path::Class.method` (nested: `outer.inner`).
The README's own 400-line rule lives in test_docs.py."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.packaging.test_import_graph import ROOT, TOP

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

# path -> the most lines it may have; only lower these numbers.
FILE_CEILINGS: dict[str, int] = {}

# path::qualified name -> the most lines it may have; only lower these numbers.
FUNCTION_CEILINGS: dict[str, int] = {}


def _files() -> dict[str, Path]:
    return {str(f.relative_to(ROOT)): f for top in TOP for f in sorted((ROOT / top).rglob("*.py"))}


def _functions(tree: ast.AST) -> dict[str, int]:
    """Qualified name → lines, for every function and method at any depth."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    files, functions = {}, {}
    for rel, path in _files().items():
        text = path.read_text()
        files[rel] = len(text.splitlines())
        for name, lines in _functions(ast.parse(text, rel)).items():
            functions[f"{rel}::{name}"] = lines
    return files, functions


def _breaches(sizes: dict[str, int], ceilings: dict[str, int], limit: int) -> list[str]:
    """What breaks the rule: a size over the limit and its ceiling, a ceiling whose entry
    is gone, or a ceiling above its entry's size (lower it)."""
    out = []
    for name, size in sorted(sizes.items()):
        ceiling = ceilings.get(name, limit)
        if size > ceiling:
            out.append(f"{name}: {size} lines, over {ceiling}; split it by concept")
        elif name in ceilings and size < ceiling:
            fix = f'set "{name}": {size},' if size > limit else f'remove "{name}" (now {size})'
            out.append(f"{name} shrank below its ceiling {ceiling}: {fix}")
    out += [f"{name}: listed but not found; remove it" for name in ceilings if name not in sizes]
    return out


def test_the_measures():
    """A stand-in source: a method is named by its class, a nested function by its outer
    one, and sizes count the `def` line through the last line of the body."""
    src = "class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n"
    assert _functions(ast.parse(src)) == {"A.m": 4, "A.m.inner": 2}
    assert _breaches({"a": 5, "b": 9, "c": 3}, {"b": 9, "c": 4}, limit=4) == [
        "a: 5 lines, over 4; split it by concept",
        'c shrank below its ceiling 4: remove "c" (now 3)',
    ]
    assert _breaches({"b": 7}, {"b": 9, "d": 8}, limit=4) == [
        'b shrank below its ceiling 9: set "b": 7,',
        "d: listed but not found; remove it",
    ]


def test_no_package_file_over_its_ceiling():
    assert _breaches(_sizes()[0], FILE_CEILINGS, MAX_FILE_LINES) == []


def test_no_function_over_its_ceiling():
    assert _breaches(_sizes()[1], FUNCTION_CEILINGS, MAX_FUNCTION_LINES) == []
