"""`posttrain run` and `validate` before anything starts: one run at a time holds a run
folder (a second run on the same --out exits 2 naming the folder and the holder's pid;
it ran and interleaved its metrics, rollouts and checkpoints), a run folder that cannot
be written exits 2 with one line (it was a PermissionError traceback), and `validate`
imports neither torch nor Ray (it took 5-12 s through the CLI's imports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posttrain.recipes import loop
from posttrain.recipes.cli import app
from posttrain.recipes.cli import checks as cli_checks
from tests.test_grpo_e2e import _grpo_recipe

REPO = Path(__file__).resolve().parents[2]

HOLD = """
import fcntl, os, sys
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.truncate(0); f.write(f"{os.getpid()}\\n"); f.flush()
print("locked", flush=True)
sys.stdin.read()
"""

TRY = """
import fcntl, sys
f = open(sys.argv[1], "a+")
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    sys.exit(3)
"""


@pytest.fixture
def started(monkeypatch):
    """`loop.run` replaced: records the run folder and whether another process could
    take its lock while the run lasts."""
    calls = []

    def fake_run(recipe, run_dir, *a, **k):
        lock = run_dir / cli_checks.LOCK_FILE
        other = subprocess.run([sys.executable, "-c", TRY, str(lock)], timeout=60)
        calls.append((run_dir, other.returncode, lock.read_text().strip()))
        return []

    monkeypatch.setattr(loop, "run", fake_run)
    return calls


def test_a_run_holds_its_folder_for_its_life(tiny_model, tmp_path, started):
    out = tmp_path / "run"
    got = CliRunner().invoke(app, ["run", str(_grpo_recipe(tmp_path, tiny_model)), "--out", out])
    assert got.exit_code == 0, got.output
    assert started == [(out, 3, str(os.getpid()))]  # locked while it ran, by this pid
    again = subprocess.run([sys.executable, "-c", TRY, str(out / cli_checks.LOCK_FILE)])
    assert again.returncode == 0  # released when the run ended


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
def test_a_second_run_on_the_same_folder_exits_2_naming_the_holder(
    tiny_model, tmp_path, started, resume, monkeypatch
):
    out = tmp_path / "run"
    out.mkdir()
    recipe = _grpo_recipe(tmp_path, tiny_model)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out / cli_checks.LOCK_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        if resume:  # the other run is past its first checkpoint
            (out / "recipe.yaml").write_text(recipe.read_text())
            _checkpoint(out, recipe, monkeypatch)
            args = ["run", "--resume", str(out)]
        else:
            args = ["run", str(recipe), "--out", str(out)]
        got = CliRunner().invoke(app, args)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert got.exit_code == 2, got.output
    assert f"run folder {out} is in use by another posttrain run (pid {holder.pid})" in got.output
    assert started == []  # nothing started


def _checkpoint(run_dir: Path, recipe_file: Path, monkeypatch) -> None:
    """A complete checkpoint after 1 step (stand-in learners, no Ray)."""
    import ray

    from posttrain.recipes import checkpoints
    from posttrain.recipes.loading import load_recipe
    from tests.recipes.test_checkpoint_manifest import FakeLearner

    with monkeypatch.context() as m:
        m.setattr(ray, "get", lambda refs, **kw: refs)
        checkpoints.save(run_dir, load_recipe(recipe_file), [FakeLearner()], 1, None, {})


def test_a_run_folder_that_cannot_be_written_exits_2_in_one_line(
    tiny_model, tmp_path, started, monkeypatch
):
    """A read-only --out (simulated: the tests may run as root, who writes anywhere) and
    an --out below a regular file."""
    recipe = str(_grpo_recipe(tmp_path, tiny_model))
    (tmp_path / "file").write_text("x")
    below_file = tmp_path / "file" / "run"
    got = CliRunner().invoke(app, ["run", recipe, "--out", str(below_file)])
    assert got.exit_code == 2, got.output
    assert got.output == (
        f"error: --out {below_file} is below a file, {tmp_path / 'file'}, not a folder; "
        "give a folder\n"
    )

    read_only = tmp_path / "ro"
    read_only.mkdir()

    def refused(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cli_checks, "open", refused, raising=False)
    got = CliRunner().invoke(app, ["run", recipe, "--out", str(read_only)])
    assert got.exit_code == 2, got.output
    assert got.output == (
        f"error: run folder {read_only}: cannot write there (Permission denied); give a "
        "folder you can write with --out NEW_DIR (or fix its permissions)\n"
    )
    assert started == []


def test_an_out_that_is_a_file_exits_2_before_the_recipe_is_checked(
    tiny_model, tmp_path, monkeypatch
):
    """A fresh user's `--out` naming a file was refused only after the recipe's checks
    had converted the model (32 s), as 'cannot write there (File exists)'."""
    import posttrain.recipes.cli as cli

    recipe = str(_grpo_recipe(tmp_path, tiny_model))
    (tmp_path / "file").write_text("x")

    def checked(*a, **k):
        raise AssertionError("the recipe was checked first")

    monkeypatch.setattr(cli, "load_or_exit", checked)
    got = CliRunner().invoke(app, ["run", recipe, "--out", str(tmp_path / "file")])
    assert got.exit_code == 2, got.output
    assert (
        got.output == f"error: --out {tmp_path / 'file'} is a file, not a folder; give a folder\n"
    )


SHIPPED = sorted(p.name for p in (REPO / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("recipe", SHIPPED)
def test_validate_imports_neither_torch_nor_ray(recipe):
    """Every shipped recipe; two need a run's output first (a teacher, a reward model)
    and exit 2 saying so, without importing either."""
    code = (
        "import sys\n"
        "from posttrain.recipes.cli import app\n"
        f"code = app(['validate', 'recipes/{recipe}'], standalone_mode=False)\n"
        "print(code or 0, sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules))\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert got.returncode == 0, got.stderr
    *_, last = got.stdout.splitlines()
    assert last in ("0 []", "2 []"), got.stdout + got.stderr
    if last == "0 []":
        assert got.stdout.startswith(f"ok: recipes/{recipe}"), got.stdout
