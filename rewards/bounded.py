"""Run verifier calls where they can be killed: a pool of worker processes with a
deadline per call and an address-space limit per worker.

Structure: `BoundedPool(size, memory_mb)` has `size` slots, each holding one worker
process (`python -m posttrain.rewards.bounded`), which imports the verifiers
(rewards/jobs.py) once at start (about a second) and then serves calls over a
socket pair. `call(fn, args, timeout_s)` takes an idle worker (waiting for one while
all are busy), sends it `(fn, args)` and waits up to `timeout_s` for the result:
- in time: the result, or `WorkerError` carrying the exception's type and message
  when `fn` raised (the worker lives on);
- too late: the worker is killed (SIGKILL: C code holding the GIL, such as SymPy
  raising 9 to a huge power, cannot be interrupted otherwise) and a replacement is
  started; the call raises `VerifierTimeout`;
- the worker died (over its memory limit, `os._exit`, a crash): replaced; `WorkerDied`.

Concurrency: `call` is thread-safe; a worker runs one call at a time; at most `size`
calls run at once. The deadline starts once the worker holds the job: waiting for a
free or starting worker is not counted. Workers are started from one launcher thread
owned by the pool, so that their parent-death signal (SIGKILL when the service dies,
Linux) is tied to a thread that lives as long as the pool. `close()` kills every
worker; a pool that is garbage-collected does the same.

Limits: `fn` must be a module-level function (pickled by reference) and its
arguments and result picklable. RLIMIT_AS bounds virtual memory, which includes what
a worker maps at start (about 0.3 GB with SymPy loaded): keep `memory_mb` well above
that. A worker keeps module state across calls: a stateful user function sees one
copy per worker, reset when its worker is replaced. A worker's stdout goes to the
service's stderr (its log). Nothing here limits CPU shares, open files or disk.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

_PRELOAD = "posttrain.rewards.jobs"
_START_TIMEOUT_S = 120.0


class VerifierTimeout(RuntimeError):
    """A call ran past its deadline; its worker was killed and replaced."""


class WorkerDied(RuntimeError):
    """A worker process ended during a call (or could not start); it was replaced."""


class WorkerError(RuntimeError):
    """The called function raised inside the worker; the message is 'Type: message'."""


class _Worker:
    """One worker process and the parent's end of its socket pair."""

    def __init__(self, memory_mb: int):
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "posttrain.rewards.bounded",
                    str(theirs.fileno()),
                    str(memory_mb),
                    _PRELOAD,
                ],
                stdin=subprocess.DEVNULL,
                stdout=2,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        try:
            if not self.conn.poll(timeout_s):
                raise WorkerDied(f"a scoring worker did not start within {timeout_s:.0f} s")
            self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            raise WorkerDied(
                f"a scoring worker exited at start (code {self.proc.poll()}); "
                "see the service log; is memory_mb too small?"
            ) from e
        self.ready = True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


def _exit_code(proc: subprocess.Popen) -> int | None:
    try:
        return proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return None


def _kill_all(workers: set[_Worker], launcher: ThreadPoolExecutor) -> None:
    for w in list(workers):
        w.kill()
    workers.clear()
    launcher.shutdown(wait=False)


class BoundedPool:
    """`size` killable worker processes, each limited to `memory_mb` MiB of address
    space; see the module docstring.

    Raises (at construction):
        ValueError: size < 1.
    """

    def __init__(self, size: int, memory_mb: int):
        if size < 1:
            raise ValueError(f"a bounded pool needs at least 1 worker, got {size}")
        self.size, self.memory_mb = size, memory_mb
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(size):
            self._idle.put(None)  # started on first use, or by warm()
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="worker-launcher")
        self._finalizer = weakref.finalize(self, _kill_all, self._workers, self._launcher)

    def _start(self) -> _Worker:
        w = self._launcher.submit(_Worker, self.memory_mb).result()
        with self._lock:
            self._workers.add(w)
        return w

    def _retire(self, w: _Worker) -> None:
        with self._lock:
            self._workers.discard(w)
        w.kill()

    def _take(self) -> _Worker:
        if not self._finalizer.alive:
            raise RuntimeError("this scoring pool is closed")
        w = self._idle.get()
        try:
            if w is None or w.proc.poll() is not None:
                if w is not None:
                    self._retire(w)
                w = None
                w = self._start()
            w.wait_ready(_START_TIMEOUT_S)
        except BaseException:
            if w is not None:
                self._retire(w)
            self._idle.put(None)
            raise
        return w

    def warm(self) -> None:
        """Start every worker now (service start-up) instead of on first use.

        Raises:
            WorkerDied: a worker could not start.
        """
        taken = []
        try:
            taken = [self._take() for _ in range(self.size)]
        finally:
            for w in taken:
                self._idle.put(w)

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """`fn(*args)` in a worker, within `timeout_s` seconds of wall time.

        Raises:
            VerifierTimeout: the deadline passed; the worker was killed and replaced.
            WorkerDied: the worker ended during the call; it was replaced.
            WorkerError: `fn` raised; the message names the exception.
            pickle.PicklingError, TypeError, AttributeError: `fn` or `args` cannot
                be sent.
        """
        payload = pickle.dumps((fn, args))
        w, keep = self._take(), False
        try:
            w.conn.send_bytes(payload)
            if not w.conn.poll(timeout_s):
                raise VerifierTimeout(
                    f"timed out after {timeout_s:g} s; the worker was killed "
                    "and replaced (raise timeout_s if this input is legitimate)"
                )
            status, value = pickle.loads(w.conn.recv_bytes())
            keep = True
        except (EOFError, OSError) as e:
            raise WorkerDied(
                f"the scoring worker died during the call (exit code "
                f"{_exit_code(w.proc)}); over its {self.memory_mb} MiB memory "
                "limit?"
            ) from e
        finally:
            if keep:
                self._idle.put(w)
            else:
                self._retire(w)
                self._idle.put(self._replacement())
        if status == "err":
            raise WorkerError(value)
        return value

    def _replacement(self) -> _Worker | None:
        """A fresh worker to take a killed one's slot (None: start it on next use)."""
        try:
            return self._start() if self._finalizer.alive else None
        except (OSError, RuntimeError):
            return None

    def close(self) -> None:
        """Kill every worker (idempotent)."""
        self._finalizer()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent thread ends (no-op elsewhere)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def _serve(fd: int, memory_mb: int, preload: str) -> None:
    """Worker loop: limit memory, import the verifiers, say ready, run calls until the
    socket closes."""
    _die_with_parent()
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    __import__(preload)
    conn = Connection(fd)
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the service closed the socket or exited
        try:
            fn, args = pickle.loads(data)
            reply = pickle.dumps(("ok", fn(*args)))
        except Exception as e:  # any failure of the job goes back to its caller
            reply = pickle.dumps(("err", f"{type(e).__name__}: {e}"))
        conn.send_bytes(reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
