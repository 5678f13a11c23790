"""Run a function on `world` learner ranks, each in its own spawned process (FSDP2 over
gloo), and return what rank 0 put on the queue (bytes of a `torch.save`)."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from queue import Empty
from typing import Any

import torch

from posttrain.common.net import free_port


def _run_then_exit(target: Callable[..., None], *args: Any) -> None:
    """Run `target(*args)` (its last argument is the result queue), flush the queue, and
    leave without interpreter finalization: gloo's worker threads can abort a process
    there after its work is done and its group destroyed ("terminate called without an
    active exception", exit -6; see pytorch/pytorch#179291). An exception in `target`
    still exits non-zero, before this point."""
    target(*args)
    queue = args[-1]
    queue.close()
    queue.join_thread()
    os._exit(0)


def _first_result(queue: Any, procs: list[Any], timeout_s: float = 300.0) -> bytes:
    """Rank 0's result; fails at once (killing the other ranks) when a rank died before
    it came, instead of waiting out `timeout_s` for a result that cannot come."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return queue.get(timeout=1.0)
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(
                    f"learner rank exited with {dead[0]}" if dead else "no result in time"
                ) from None


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 300.0) -> Any:
    """`target(rank, world, *args, port, queue)` on every rank; rank 0's result, within
    `timeout_s` seconds (a bench's many real-model steps need more than a test's).

    Raises:
        AssertionError: a rank exited with a non-zero code.
    """
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_run_then_exit, args=(target, r, world, *args, port, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    result = torch.load(io.BytesIO(_first_result(queue, procs, timeout_s)), weights_only=False)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"learner rank exited with {p.exitcode}"
    return result
