"""The quick tier (`pytest -m quick`, set in tests/conftest.py) stays what it says: its
marker is registered (`--strict-markers` is on), every entry of its lists names a test
that exists (a renamed test would silently rejoin or leave the tier), each role keeps an
end-to-end smoke in it, and `-m quick` on the command line replaces the default
`-m 'not slow'` of pyproject's addopts."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib

from tests.conftest import NOT_QUICK, QUICK_SMOKES, ROOT

ROLES = {"actors", "learner", "rewards", "weightsync"}


def _tests_of(path: str) -> set[str]:
    """Names of the test functions of a test module."""
    tree = ast.parse((ROOT / path).read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _missing(entry: str) -> bool:
    """Whether a node id (or a prefix of one) names no test module or function."""
    path, _, name = entry.partition("::")
    if path.endswith("/") or path == "tests/test_":
        return not any(ROOT.glob(f"{path}*.py" if not path.endswith("/") else f"{path}*"))
    if not (ROOT / path).is_file():
        return True
    name = name.split("[", 1)[0]
    return bool(name) and not any(t.startswith(name) for t in _tests_of(path))


def test_the_marker_is_registered():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert any(m.startswith("quick:") for m in config["ini_options"]["markers"])


def test_every_listed_test_exists():
    assert [e for e in [*NOT_QUICK, *QUICK_SMOKES.values()] if _missing(e)] == []
    assert _missing("tests/learner/test_fsdp.py::test_no_such_test")
    assert _missing("tests/learner/no_such_module.py")


def test_each_role_keeps_a_smoke():
    assert ROLES <= set(QUICK_SMOKES)
    for role in ROLES:
        assert QUICK_SMOKES[role].startswith(f"tests/{role}/")


def test_minus_m_quick_selects_the_tier():
    """The smokes are collected under `-m quick` although their modules are left out, and
    a slow test is not (the command line's `-m` replaces addopts' `-m 'not slow'`)."""
    smokes = sorted(QUICK_SMOKES.values())
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-m", "quick", *smokes]
        + ["tests/test_real_model.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = sorted(line for line in out.stdout.splitlines() if "::" in line)
    assert collected == smokes, out.stdout[-3000:] + out.stderr[-3000:]
