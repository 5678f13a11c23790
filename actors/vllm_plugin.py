"""A vLLM general plugin (entry point group `vllm.general_plugins`, pyproject.toml): vLLM
loads it in every process it starts (the engine core and its workers included), before
they build their message queues. It acts only where `AsyncVLLMEngine` on CPU asked for it
through `SHM_BUSY_LOOP_ENV`, which the processes it spawns inherit; anywhere else it
does nothing.

Why: vLLM's `AsyncLLM` always runs its engine core in a child process, and on CPU its
model in a worker process of the core's (the CPU platform forces the multiprocessing
executor). The two pass each step's scheduler output and model output through shared
memory queues whose readers spin (`sched_yield`) for a second after every read before
they wait on a socket. While the worker ran a step's forward, the core's reader spun for
its output: on 2 cores that was 0.21-0.29 of a core taken from the forward's two OpenMP
threads (measured per thread on machine H, docs/benchmarks.md). With the spin off each
reader sleeps on the queue's socket notification instead, looking at the queue again
at least every `RECHECK_MS`.
"""

from __future__ import annotations

import logging
import math
import os

#: Seconds a shared-memory queue reader spins after a read (vLLM's default: 1.0).
SHM_BUSY_LOOP_ENV = "POSTTRAIN_VLLM_SHM_BUSY_LOOP_S"

#: Longest a reader that does not spin sleeps before it looks at the queue again, ms.
#: vLLM's own is 5000: a reader relies on the writer's socket notification to wake, and
#: with 4 callers adding requests mid-step a notification went missing often enough
#: that rounds took 2 x 5 s longer (bench/rollout.py, docs/benchmarks.md).
RECHECK_MS = 10

log = logging.getLogger(__name__)


def busy_loop_seconds(environ: dict[str, str] | os._Environ = os.environ) -> float | None:
    """`SHM_BUSY_LOOP_ENV` as seconds, or None when it is not set.

    Raises:
        ValueError: the value is not a finite number ≥ 0.
    """
    raw = environ.get(SHM_BUSY_LOOP_ENV)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{SHM_BUSY_LOOP_ENV}={raw!r}: expected a finite number of seconds ≥ 0")
    return seconds


def register() -> None:
    """vLLM's plugin hook: cap how long every shared-memory queue reader of this process
    spins after a read at `busy_loop_seconds()`, and how long it then sleeps between
    looks at the queue at `RECHECK_MS`; nothing when it is unset. A vLLM without
    the queue's `SpinCondition` keeps its own behaviour (logged)."""
    seconds = busy_loop_seconds()
    if seconds is None:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        wait = SpinCondition.wait
    except (ImportError, AttributeError) as e:
        log.warning("posttrain: vLLM's shared-memory queue has changed (%s); readers spin", e)
        return
    original = getattr(wait, "posttrain_original", wait)

    def capped_wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = min(self.busy_loop_s, seconds)
        recheck = RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS)
        return original(self, recheck)

    capped_wait.posttrain_original = original  # type: ignore[attr-defined]
    SpinCondition.wait = capped_wait
