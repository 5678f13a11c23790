"""The wheel installs everything under one name, `posttrain.*`: next to a user's own
top-level `common` (or `recipes`) module, both import, and neither replaces the other."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import ROOT


def test_wheel_installs_only_the_posttrain_namespace(tmp_path: Path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    # a data folder left out of `packages` still builds, with a warning per folder
    assert "absent from the `packages` configuration" not in build.stderr, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("posttrain-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {
        "posttrain",
        wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info",
    }, tops
    # a clean venv holding the wheel and a user's package with top-level common/recipes
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for mod in ("common", "recipes"):
        (site / mod).mkdir()
        (site / mod / "__init__.py").write_text(f"OWNER = 'user-{mod}'\n")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    # posttrain.config needs pydantic: borrow this interpreter's packages, after the venv's
    ours = next(p for p in sys.path if p.endswith("site-packages"))
    code = (
        f"import sys; sys.path.append({ours!r}); import common, recipes; "
        "import posttrain.config, posttrain.common.net; "
        "assert common.OWNER == 'user-common' and recipes.OWNER == 'user-recipes'; "
        f"assert posttrain.config.__file__.startswith({str(site)!r}); print('ok')"
    )
    run = subprocess.run(
        [py, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )  # not the checkout, whose folders sit on sys.path[0]
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    # the data samples the shipped recipes read travel in the wheel, with their licences
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (
        "gsm8k/train.jsonl",
        "gsm8k/test.jsonl",
        "gsm8k/LICENSE",
        "hh-rlhf-harmless/harmless-base-test.jsonl.gz",
        "hh-rlhf-harmless/LICENSE",
        "README.md",
    ):
        assert f"posttrain/recipes/datasets/{f}" in names, f
    code = (
        f"import sys; sys.path.append({ours!r}); from pathlib import Path; "
        "import posttrain.recipes as p; from posttrain.recipes.loading import load_recipe; "
        "from posttrain.recipes.data import load_data; "
        "n = [len(load_data(load_recipe(Path(p.__file__).parent / f)).train) "
        "for f in ('grpo_gsm8k.yaml', 'dpo_hh.yaml')]; print(n)"
    )
    run = subprocess.run(
        [py, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 0 and run.stdout.strip() == "[400, 640]", run.stderr[-2000:]
