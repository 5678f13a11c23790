"""Every shipped recipe validates in a fresh copy of the repository with no
`../shared/data` beside it: the data the recipes read ships in recipes/datasets/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.packaging.test_import_graph import TOP  # the package's folders

_VALIDATE_ALL = """
import json, sys
from pathlib import Path
from typer.testing import CliRunner
from posttrain.recipes.cli import app
out = {}
for f in sorted(Path("recipes").glob("*.yaml")):
    # recipes that read another run's output get the tiny model in its place
    extra = {
        "ppo_hh_rm.yaml": ["--set", f"rewards.0.path={sys.argv[1]}"],
        "distill_quickstart.yaml": [
            "--set", f"distill.teacher={sys.argv[1]}", "--set", f"model.path={sys.argv[1]}",
            "--set", "rollout.engine=hf",
        ],
    }.get(f.name, [])
    got = CliRunner().invoke(app, ["validate", str(f), *extra])
    out[f.name] = [got.exit_code, got.output[-400:]]
print(json.dumps(out))
"""


def test_shipped_recipes_validate_in_a_clone_without_shared_data(tmp_path, tiny_model):
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout ({listed.stderr.strip()[:80]})")
    clone = tmp_path / "clone"
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    assert not (tmp_path / "shared").exists() and not (clone.parent.parent / "shared").exists()
    farm = clone / ".pt" / "posttrain"
    farm.mkdir(parents=True)
    for top in TOP:
        (farm / top).symlink_to(clone / top)
    env = {**os.environ, "PYTHONPATH": str(clone / ".pt")}
    run = subprocess.run(
        [sys.executable, "-c", _VALIDATE_ALL, str(tiny_model)],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    failed = {name: out for name, (code, out) in results.items() if code != 0}
    assert not failed, failed
