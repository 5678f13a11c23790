"""TRL's own virtualenv for the benches that run TRL side by side with posttrain
(`vs_trl.py`, `sft.py`): TRL imports nothing of posttrain and pins its own packages."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VENV = Path(__file__).resolve().parents[1] / ".bench-venv" / "trl"
PACKAGES = ("torch==2.13.0", "trl==1.16.0", "datasets")


def trl_python(smoke: bool) -> Path | None:
    """The python of `VENV`, made on first use (minutes: pip installs `PACKAGES`); None
    when `smoke` finds no `VENV` (a smoke run installs nothing; only posttrain's side
    runs).

    Raises:
        subprocess.CalledProcessError: making the virtualenv failed.
    """
    py = VENV / "bin" / "python"
    if smoke and not py.exists():
        print(
            f"TRL side skipped: {VENV} does not exist and --smoke installs nothing (run "
            "without --smoke once to make it); only posttrain's side runs"
        )
        return None
    if not py.exists():
        print(f"making {VENV} ({', '.join(PACKAGES)}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    return py


def run_trl_worker(py: Path, script: str, argv: list[str]) -> Any:
    """Run `script --trl-worker ARGV --save F` under TRL's python `py` (from a neutral
    working directory, so posttrain's folders do not shadow TRL's imports) and return the
    JSON the worker saved to F.

    Raises:
        subprocess.CalledProcessError: the worker failed.
    """
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(
            [str(py), script, "--trl-worker", *argv, "--save", f.name],
            check=True,
            cwd=tempfile.gettempdir(),
        )
        return json.loads(Path(f.name).read_text())
