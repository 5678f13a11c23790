"""Run a function on `world` learner ranks, each in its own spawned process (FSDP2 over
gloo), and return what rank 0 put on the queue (bytes of a `torch.save`)."""

from __future__ import annotations

import io
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import torch

from posttrain.common.net import free_port


def run_ranks(target: Callable[..., None], world: int, *args: Any) -> Any:
    """`target(rank, world, *args, port, queue)` on every rank; rank 0's result.

    Raises:
        AssertionError: a rank exited with a non-zero code.
    """
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, world, *args, port, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    result = torch.load(io.BytesIO(queue.get(timeout=300)), weights_only=False)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"learner rank exited with {p.exitcode}"
    return result
