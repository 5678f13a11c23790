"""scripts/gpu_check.sh without CUDA: every device row says skipped, the gpu test files
still run (their tests skip), one table, exit 0."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode of the check")
def test_gpu_check_runs_its_cpu_parts():
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "no CUDA device" in out and "check" in out and "notes" in out
    for row in ("learner (FSDP2+NCCL", "HF engine generate", "CUDA-IPC hand-off"):
        assert any(line.startswith(row) and "skipped" in line for line in out.splitlines())
    pytest_line = next(line for line in out.splitlines() if line.startswith("pytest -m gpu"))
    assert "| ok" in pytest_line and "skipped" in pytest_line and "failed" not in pytest_line
