"""TRL's own virtualenv for the benches that run TRL side by side with posttrain
(`vs_trl.py`, `sft.py`): TRL imports nothing of posttrain and pins its own packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
