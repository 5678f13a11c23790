"""Run untrusted Python programs (model-written code) in a local OS sandbox.

`BwrapSandbox` layers, for every run:
- bubblewrap with every namespace unshared (user, pid, net, ipc, uts, cgroup): no
  network at all (a private loopback only), its own pid 1, `--die-with-parent`;
- a read-only view of /usr, /lib*, /bin and nothing else of the host's files; a fresh
  tmpfs of at most `Limits.tmpfs_mb` as the work dir and another as /tmp (tmpfs lives
  in host RAM: unsized, one program filled 1 GiB of it in under a second), gone when the
  run ends; the rest of the root read-only;
- an unprivileged host uid per concurrent run (when the service runs as root), so the
  process-count limit and file permissions are per run;
- rlimits: address space, CPU seconds, processes, file size, no core dumps;
- a seccomp filter refusing kernel-facing calls (ptrace, mount, bpf, keyctl, new
  namespaces, ...) and sockets other than AF_UNIX;
- a wall-clock timeout that kills the whole process group; output read as it comes, at
  most `max_output_bytes` of each stream kept and the rest discarded unread into memory
  (1 GiB on stderr took the reward service from 345 MB to 2.4 GB when it was read
  whole, then cut).

What it does NOT protect against: kernel or bubblewrap vulnerabilities (the host
kernel is shared); CPU and memory-bandwidth contention with the rest of the machine
within the limits (runs slow each other down); reading world-readable files under
/usr (installed software is visible); timing side channels; a program that prints
the test cases it was given. The Python inside is the system `/usr/bin/python3`
(stdlib only). It is not a substitute for a VM when the code's author is hostile and
skilled; it is a containment layer for buggy or reward-hacking model outputs.

A run may carry a `secret` (bytes): it waits in a pipe whose file descriptor number is
the program's last argument (`sys.argv[-1]`), never in the program's text or
environment. The code reward uses it for its completion marker (rewards/code_verifier.py).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import IO

from .seccomp import seccomp_fd as _seccomp_fd

SANDBOX_PYTHON = "/usr/bin/python3"
_UID_BASE = 61000


@dataclass(frozen=True)
class Limits:
    """Per-run limits: seconds (wall, CPU), MiB, processes, bytes. `tmpfs_mb`: the size
    of each of the run's two tmpfs (the work dir and /tmp; bwrap only)."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    max_procs: int = 32
    file_mb: int = 16
    max_output_bytes: int = 65536
    tmpfs_mb: int = 64


@dataclass(frozen=True)
class RunResult:
    """Outcome of one program run. `returncode` is negative for a signal; `timed_out`
    when the wall clock ran out; `truncated` when output was cut at the limit."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start here; the message says why and how to fix it."""


class _UidPool:
    """Hands out distinct unprivileged uids to concurrent runs, oldest first.

    Seen here: a finished run's processes keep counting against its uid's
    RLIMIT_NPROC for up to ~1.5 s while the kernel tears its namespaces down, so a uid
    reused at once fails to fork. A large pool makes reuse seconds apart."""

    def __init__(self, size: int = 1024):
        self._free = list(range(_UID_BASE, _UID_BASE + size))
        self._lock = threading.Condition()

    def acquire(self) -> int:
        with self._lock:
            while not self._free:
                self._lock.wait()
            # Oldest first: a uid's last processes may still be tearing down in the kernel.
            return self._free.pop(0)

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)
            self._lock.notify()


def _rlimits(limits: Limits, uid: int | None):
    def apply() -> None:
        mem = limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))
        size = limits.file_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


class _CappedReader(threading.Thread):
    """Reads a pipe to its end, keeping its first `cap` bytes and discarding the rest
    as it comes, so memory stays bounded whatever the program prints (the program never
    blocks on a full pipe either)."""

    def __init__(self, stream: IO[bytes], cap: int):
        super().__init__(daemon=True)
        self.stream, self.cap = stream, cap
        self.kept = bytearray()
        self.cut = False

    def run(self) -> None:
        fd = self.stream.fileno()
        try:
            while chunk := os.read(fd, 65536):
                room = self.cap - len(self.kept)
                if len(chunk) > room:
                    self.cut = True
                self.kept += chunk[: max(room, 0)]
        except OSError:  # a read error ends the stream like its end
            pass

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


def _feed(stream: IO[bytes], data: bytes) -> None:
    """Write `data` to the program's stdin and close it; a program that exits or closes
    its stdin first is not an error."""
    try:
        stream.write(data)
    except OSError:  # BrokenPipeError: the program is gone or closed its stdin
        pass
    finally:
        try:
            stream.close()
        except OSError:
            pass


def _secret_pipe(secret: bytes) -> int:
    """The read end of a pipe already holding `secret` (its write end closed).

    Raises:
        ValueError: `secret` is over 4096 bytes (it must fit the pipe without blocking).
    """
    if len(secret) > 4096:
        raise ValueError(f"a run's secret must be at most 4096 bytes, got {len(secret)}")
    r, w = os.pipe()
    try:
        os.write(w, secret)
    finally:
        os.close(w)
    return r


def _run(
    argv: list[str],
    stdin: str | None,
    limits: Limits,
    uid: int | None,
    pass_fds: tuple[int, ...] = (),
    cwd: str | None = None,
    secret: bytes | None = None,
) -> RunResult:
    start = time.monotonic()
    secret_fd = None if secret is None else _secret_pipe(secret)
    if secret_fd is not None:
        argv, pass_fds = [*argv, str(secret_fd)], (*pass_fds, secret_fd)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_rlimits(limits, uid),
            start_new_session=True,
            pass_fds=pass_fds,
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
        )
    finally:
        if secret_fd is not None:
            os.close(secret_fd)  # the child holds its own copy
    readers = [_CappedReader(s, limits.max_output_bytes) for s in (proc.stdout, proc.stderr)]
    feeder = threading.Thread(target=_feed, args=(proc.stdin, (stdin or "").encode()), daemon=True)
    for t in (*readers, feeder):
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for t in readers:  # a process that escaped the group may hold a pipe: do not wait on it
        t.join(timeout=5.0)
        if not t.is_alive():  # one still reading keeps its pipe (closing it under a
            t.stream.close()  # blocked read could hand the fd's number to another file)
    out, err = readers
    return RunResult(
        proc.returncode,
        out.text(),
        err.text(),
        timed_out,
        out.cut or err.cut,
        time.monotonic() - start,
    )


class BwrapSandbox:
    """bubblewrap + rlimits + seccomp + per-run uid; see the module docstring.

    Raises (at construction):
        SandboxUnavailable: bwrap, pyseccomp or /usr/bin/python3 is missing, or a
            trial run fails (e.g. user namespaces disabled); the message says why.
    """

    def __init__(self) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable(
                "bubblewrap (bwrap) is not installed; install it (Debian: apt-get install "
                "bubblewrap) or set the code reward's sandbox: none for trusted code only"
            )
        if not os.path.exists(SANDBOX_PYTHON):
            raise SandboxUnavailable(f"{SANDBOX_PYTHON} is missing; install python3 (Debian)")
        try:
            os.close(_seccomp_fd())
        except (ImportError, OSError, RuntimeError) as e:
            raise SandboxUnavailable(
                f"cannot build the seccomp filter ({e}); install pyseccomp and libseccomp2"
            ) from e
        self.uids = _UidPool() if os.geteuid() == 0 else None
        trial = self.run("print(6 * 7)", None, Limits(wall_s=30))
        if trial.stdout.strip() != "42":
            raise SandboxUnavailable(
                f"a trial run in bubblewrap failed (exit {trial.returncode}): "
                f"{trial.stderr.strip()[-300:]}; are unprivileged user namespaces enabled?"
            )

    def _argv(self, seccomp_fd: int, tmpfs_mb: int) -> list[str]:
        binds = [
            a
            for d in ("/usr", "/bin", "/lib", "/lib64", "/lib32")
            if os.path.exists(d)
            for a in ("--ro-bind", d, d)
        ]
        return [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            *binds,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(tmpfs_mb * 2**20),
            "--tmpfs",
            "/tmp",
            "--size",
            str(tmpfs_mb * 2**20),
            "--tmpfs",
            "/work",
            "--remount-ro",
            "/",
            "--chdir",
            "/work",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/work",
            "--seccomp",
            str(seccomp_fd),
            SANDBOX_PYTHON,
            "-I",
            "-c",
        ]

    def run(
        self, code: str, stdin: str | None, limits: Limits, secret: bytes | None = None
    ) -> RunResult:
        """Run `code` with `stdin` (None: empty) under `limits`; `secret`: see the module
        docstring."""
        res = self._run_once(code, stdin, limits, secret)
        for delay in (0.5, 1.0):
            # bwrap itself could not fork (see _UidPool): the program never ran; retry.
            if not res.stderr.startswith("bwrap: Can't fork"):
                break
            time.sleep(delay)
            res = self._run_once(code, stdin, limits, secret)
        return res

    def _run_once(
        self, code: str, stdin: str | None, limits: Limits, secret: bytes | None
    ) -> RunResult:
        fd = _seccomp_fd()
        uid = self.uids.acquire() if self.uids else None
        try:
            return _run(
                [*self._argv(fd, limits.tmpfs_mb), code],
                stdin,
                limits,
                uid,
                pass_fds=(fd,),
                cwd="/",
                secret=secret,
            )
        finally:
            os.close(fd)
            if uid is not None:
                self.uids.release(uid)


class NoSandbox:
    """A bare subprocess with rlimits only: for trusted code and for measuring the
    sandbox's overhead. Warns at every start."""

    def __init__(self) -> None:
        warnings.warn(
            "code reward runs WITHOUT a sandbox (sandbox: none): model-written "
            "programs can reach the network, the disk and this host",
            stacklevel=2,
        )

    def run(
        self, code: str, stdin: str | None, limits: Limits, secret: bytes | None = None
    ) -> RunResult:
        """Run `code` with `stdin` (None: empty) under `limits`; `secret`: see the module
        docstring."""
        with tempfile.TemporaryDirectory() as work:
            return _run(
                [SANDBOX_PYTHON, "-I", "-c", code], stdin, limits, None, cwd=work, secret=secret
            )


def make_sandbox(kind: str) -> BwrapSandbox | NoSandbox:
    """The sandbox for a code reward's `sandbox:` setting.

    Raises:
        SandboxUnavailable: 'bwrap' cannot start here.
        ValueError: an unknown kind.
    """
    if kind == "bwrap":
        return BwrapSandbox()
    if kind == "none":
        return NoSandbox()
    raise ValueError(f"sandbox {kind!r} is unknown; use 'bwrap' or 'none'")
