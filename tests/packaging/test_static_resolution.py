"""A static tool resolves the package's own imports by path: jedi (the engine behind
editors' go-to-definition) follows every imported name of a few central modules to a
file of this checkout. With the old absolute `posttrain.*` imports it could not: the
package name is mapped onto the folders by pyproject, not a folder itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

jedi = pytest.importorskip("jedi")

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["recipes/loop.py", "recipes/algo/grpo.py", "learner/worker.py", "actors/worker.py"]


def _position(lines: list[str], node: ast.ImportFrom, name: str) -> tuple[int, int]:
    """Line and column of `name` among the imported names of `node`."""
    for i in range(node.lineno, node.end_lineno + 1):
        text = lines[i - 1]
        start = text.index(" import ") + 8 if i == node.lineno else 0
        m = re.search(rf"\b{re.escape(name)}\b", text[start:])
        if m:
            return i, start + m.start()
    raise AssertionError(f"{name} not found in the import at line {node.lineno}")


@pytest.mark.parametrize("module", MODULES)
def test_jedi_resolves_every_relative_import_into_the_checkout(module):
    path = ROOT / module
    source = path.read_text()
    script = jedi.Script(source, path=path, project=jedi.Project(ROOT))
    lines = source.splitlines()
    unresolved, checked = [], 0
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        for alias in node.names:
            line, col = _position(lines, node, alias.name)
            found = script.goto(line, col, follow_imports=True)
            checked += 1
            where = [d.module_path for d in found if d.module_path is not None]
            if not where or not all(ROOT in Path(p).parents for p in where):
                unresolved.append(f"{module}:{line} {alias.name} -> {where}")
    assert checked > 0
    assert unresolved == []
