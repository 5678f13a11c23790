"""Per-process set-up for workers that do heavy math on a few cores."""

from __future__ import annotations

import os
from pathlib import Path

#: CPU flags (Linux /proc/cpuinfo) of instructions that multiply bf16 matrices natively:
#: x86's AVX512-BF16 and AMX-BF16, Arm's BF16 extension.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def set_torch_threads(threads: int) -> None:
    """Pin torch (and BLAS) to `threads` cores; call first thing in every worker.

    Two workers with all cores each would oversubscribe a small machine and slow both.
    """
    import torch

    threads = max(1, threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process; harmless
        pass


#: jemalloc's settings for a CPU role. Decay off: freed pages are never handed back to
#: the OS, so the buffers a step frees are the next step's without page faults.
#: `lg_extent_max_active_fit:10`: a free extent up to 1024x a request may be split for
#: it; at jemalloc's default (64x) the learner's large freed buffers were not reused for
#: the next step's smaller ones, and with decay off it mapped new memory every step, 0.6
#: to 1.5 GB a step on SmolLM2 (docs/benchmarks.md). `thp:always`: its memory in
#: transparent huge pages where the kernel allows (madvise), 1/512 of the page faults.
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1,lg_extent_max_active_fit:10,thp:always"
#: Set to "system" to keep glibc's malloc in the learner and rollout processes.
ALLOCATOR_ENV = "POSTTRAIN_CPU_ALLOCATOR"


def jemalloc_library() -> str | None:
    """A jemalloc shared library to preload: the system's (`libjemalloc.so.2`, e.g. the
    Debian package libjemalloc2), else the one Ray's wheel ships (`ray/core/
    libjemalloc.so`); None when neither is there."""
    import ctypes.util
    import importlib.util

    if name := ctypes.util.find_library("jemalloc"):
        return name
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        return None
    bundled = Path(spec.origin).parent / "core" / "libjemalloc.so"
    return str(bundled) if bundled.is_file() else None


def cpu_allocator_env(device: str) -> dict[str, str]:
    """Environment variables for a learner rank or rollout worker on `device`: on CPU,
    jemalloc preloaded with `JEMALLOC_CONF`; {} on cuda, when
    `POSTTRAIN_CPU_ALLOCATOR=system`, when the caller already preloads a library
    (LD_PRELOAD set) or when no jemalloc is found.

    Why: with glibc's malloc every buffer above 32 MiB (the largest gradients, the
    flattened gradients FSDP2 copies at a step's last backward, a push's tensors in the
    engine) is a fresh mmap, freed with munmap, so its pages fault again every step; on
    a virtual machine whose host takes freed pages back, a probe's faults cost 2 to 13 us
    each, and the last backward of a one-rank quickstart step (the one that hands the
    gradients over) took a median of 1.5 to 4.1 s from run to run where the first took
    1.1 s (docs/benchmarks.md)."""
    if device != "cpu" or os.environ.get(ALLOCATOR_ENV) == "system":
        return {}
    if os.environ.get("LD_PRELOAD") or (lib := jemalloc_library()) is None:
        return {}
    return {"LD_PRELOAD": lib, "MALLOC_CONF": JEMALLOC_CONF}


def default_threads(workers_at_once: int) -> int:
    """Cores per worker when `workers_at_once` workers compute at the same time."""
    return max(1, (os.cpu_count() or 1) // max(1, workers_at_once))


#: Loggers whose warnings are known to be harmless here, and why; `quiet_logs` keeps
#: their errors only.
QUIET_LOGGERS = {
    # when transformers imports it: one line per CUDA kernel library (.so) this machine
    # cannot load (every CPU machine; we use torchao's NF4 only, pure torch)
    "torchao": "kernel libraries it cannot load",
    # torch's deprecation note on torchao registering its Enums (one line per Enum)
    "torch.utils._pytree": "register_constant() on Enum subclasses is deprecated",
    # the embedded local cluster turning on token authentication, its secure default
    "ray._private.authentication.authentication_token_setup": "token authentication",
}


def quiet_logs() -> None:
    """Keep only the errors of `QUIET_LOGGERS` (no import: the CLI calls it first, and
    every Ray worker process at its start, `worker_process_setup_hook` in
    recipes/roles.py `init_ray`, before the worker imports torch)."""
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_libraries() -> None:
    """Turn off per-load progress bars of transformers (one per worker per load) so the
    console shows the training progress bar and real warnings only, and `quiet_logs`."""
    quiet_logs()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def split_cores(
    rollout_workers: int,
    learner_workers: int,
    rollout_cores: int | None = None,
    cores: int | None = None,
) -> tuple[int, int]:
    """Threads per rollout worker and per learner rank when both sides compute at once
    (asynchronous training): `rollout_cores` (default half the cores) go to the rollout
    workers, the rest to the learner ranks, each side at least one core and each worker
    at least one thread.

    Args:
        cores: the machine's cores (default `os.cpu_count()`).
    """
    cores = cores or os.cpu_count() or 1
    share = rollout_cores or max(1, cores // 2)
    share = min(share, max(1, cores - 1))
    rest = max(1, cores - share)
    return max(1, share // max(1, rollout_workers)), max(1, rest // max(1, learner_workers))


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU multiplies bf16 matrices natively (one of `BF16_FLAGS` among the
    `flags`/`Features` of `cpuinfo`); None when that cannot be read (not Linux). Without
    them torch converts bf16 operands to float32 and back around each product, which
    makes bf16 compute slower than float32 (measured in docs/benchmarks.md, "bf16 against
    float32 on B")."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(BF16_FLAGS & set(value.split()))
    return None


def bf16_note(device: str, dtype: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """A console note when a recipe computes in bf16 on a CPU without bf16 instructions
    (`cpu_has_bf16` False); None otherwise. The recipe is left as it is: switching the
    dtype would change the run's numbers."""
    if device != "cpu" or dtype != "bfloat16" or cpu_has_bf16(cpuinfo) is not False:
        return None
    return (
        "note: model.dtype is bfloat16, but this CPU has no bf16 matrix instructions "
        "(none of avx512_bf16, amx_bf16, bf16 in /proc/cpuinfo), so bf16 matmuls are "
        "emulated and run slower than float32; --set model.dtype=float32 trains and "
        "samples faster here, with float32 engine weights (twice the memory)"
    )
