"""The package's import graph, read from the source: no import circle anywhere (imports
inside functions count; `if TYPE_CHECKING:` blocks do not), no role importing another
role's internals, and every package-internal import written relative, so static tools
(pyright, an editor's go-to-definition) resolve it by path."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = [
    "actors",
    "algorithms",
    "common",
    "config",
    "learner",
    "recipes",
    "rewards",
    "service",
    "weightsync",
]


def _modules() -> dict[str, Path]:
    """`posttrain.<folder>.<...>` → file, for every module of the package."""
    out = {}
    for top in TOP:
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(["posttrain", *parts])] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, outside `if TYPE_CHECKING:` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _bound_names(path: Path) -> set[str]:
    """Names a package's `__init__` binds at top level (re-exports, defs, assignments)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports. `from pkg import x` is an edge to `pkg` when
    its `__init__` binds `x` (a re-export), else to the submodule `pkg.x`."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
            continue
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""]).strip(".")
        else:
            base = node.module or ""
        bound = (
            _bound_names(modules[base])
            if modules.get(base, Path()).name == "__init__.py"
            else set()
        )
        for a in node.names:
            sub = f"{base}.{a.name}"
            add(sub if sub in modules and a.name not in bound else base)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {n: _edges(n, p, modules) for n, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan 1972)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_walker_sees_every_kind_of_import():
    """A stand-in graph: a lazy import inside a function is an edge; one under
    TYPE_CHECKING is not; the cycle finder finds a two-module circle."""
    src = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from posttrain.b import X\n"
        "def f():\n    from .c import y\n"
    )
    nodes = _imports(ast.parse(src))
    assert [getattr(n, "module", None) for n in nodes] == ["typing", "c"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_in_the_package():
    assert _cycles(_graph()) == []


def test_package_imports_are_relative():
    """Inside the package, imports of the package itself are relative (a static tool then
    resolves them by path; `posttrain.*` is a mapped name, not a folder)."""
    absolute = []
    for path in _modules().values():
        for node in _imports(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if isinstance(node, ast.ImportFrom) and node.level:
                continue
            if any(m and (m == "posttrain" or m.startswith("posttrain.")) for m in mods):
                absolute.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert absolute == []


ROLES = ["actors", "learner", "rewards", "weightsync"]


def test_no_role_imports_another_role_or_the_control_plane():
    """Roles share `common`, `config` and `algorithms`; a role may use another role's
    public package (`posttrain.weightsync`: both sides of a push), never its modules, and
    none imports `recipes` (the control plane knows every role, never the other way)."""
    bad = []
    for name, targets in _graph().items():
        role = name.split(".")[1]
        if role not in ROLES:
            continue
        for t in targets:
            other = t.split(".")[1]
            internals = other in ROLES and t != f"posttrain.{other}"
            if other != role and (internals or other == "recipes"):
                bad.append(f"{name} -> {t}")
    assert bad == []


def test_the_data_wing_imports_only_config_common_and_itself():
    """recipes/data/ turns data blocks into items for every algorithm; it knows no role,
    no loop and no other part of the control plane, so any of them may use it."""
    wing = "posttrain.recipes.data"
    allowed = ("posttrain.config", "posttrain.common", wing)
    bad = [
        f"{name} -> {t}"
        for name, targets in _graph().items()
        if name == wing or name.startswith(f"{wing}.")
        for t in targets
        if not any(t == a or t.startswith(f"{a}.") for a in allowed)
    ]
    assert bad == []


def test_recipes_has_at_most_22_flat_modules():
    assert len(list((ROOT / "recipes").glob("*.py"))) <= 22
