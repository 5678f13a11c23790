"""Stand-in of `verifiers.v1.runtimes`: the local subprocess runtime (a working directory
per episode; a PEP 723 script "prepared" by writing it, run by this interpreter where
the real one makes a uv environment) and `ProgramResult`. Each program prepared or
started is said on stderr (`stand-in runtime: ...`), so a test can count them."""

import asyncio
import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ProgramResult:
    exit_code: int
    stdout: str
    stderr: str


class SubprocessRuntime:
    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="vf-standin-"))
        self.env: dict[str, str] = {}
        self.user: str | None = None

    async def write(self, path: str, data: bytes) -> None:
        (self.workdir / path).write_bytes(data)

    async def prepare_uv_script(self, script: str, env=None, *, activate: bool = True) -> list[str]:
        path = self.workdir / f"{hashlib.sha256(script.encode()).hexdigest()}.py"
        path.write_text(script)
        print(f"stand-in runtime: prepared program {path.name}", file=sys.stderr)
        return [sys.executable, str(path)]

    async def run_program(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        print(f"stand-in runtime: started program {Path(argv[1]).name}", file=sys.stderr)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env={**os.environ, **self.env, **env},
            cwd=self.workdir,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        return ProgramResult(proc.returncode or 0, out.decode(), err.decode())

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
