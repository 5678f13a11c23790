"""The lines every bench prints above its table: what ran, where and on which code, so a
number quoted from a table carries its machine, load, command and commit.

    from _header import header   # bench/ is sys.path[0] when a bench runs
    print(header())

Lines (each starts with `# `): the command as typed (`sys.argv`), the commit (`git
rev-parse --short HEAD`, `+dirty` when tracked files differ; `unknown` outside a git
checkout), the CPU model and core count, the CPU flags that decide torch's CPU kernels
(AVX2/AVX-512/AMX and bf16/fp16/VNNI support), the load average (1/5/15 min) and the
torch version. Linux only for the CPU and load lines (`/proc`); elsewhere they say
`unknown`.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The flags of /proc/cpuinfo that change which CPU kernels torch and vLLM pick.
FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of `FLAGS` it has (in `FLAGS` order)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", []
    fields = dict(
        line.split(":", 1) for line in text.splitlines()[:60] if ":" in line and line.strip()
    )
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    have = set(fields.get("flags", "").split())
    return fields.get("model name", "unknown"), [f for f in FLAGS if f in have]


def loadavg() -> str:
    """`/proc/loadavg`'s 1, 5 and 15 minute averages, or `unknown`."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def commit() -> str:
    """Short commit of this checkout, `+dirty` when tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def header() -> str:
    """The lines above a bench's table (see the module docstring)."""
    import torch

    model, flags = cpu()
    argv = [os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "?", *sys.argv[1:]]
    return "\n".join(
        [
            f"# command: python {shlex.join(argv)}",
            f"# commit: {commit()}; torch {torch.__version__}",
            f"# CPU: {model}, {os.cpu_count()} cores; flags: {' '.join(flags) or 'none'}",
            f"# load average (1/5/15 min): {loadavg()}",
        ]
    )
