"""The state of one running job, `Run`: what a step, an algorithm object, the samplers,
the asynchronous producer, checkpoints and the learner recovery may use. It lives in a
module of its own, which imports nothing of the package at run time, so each of those
modules can name its type without an import circle.

Who changes it: `recipes/loop.py` builds it once the roles run and sets `sampler` and
`prompts`; the asynchronous step (`recipes/async_loop/step.py`) sets `stream` on its
first call and hands `prompts` to the producer; the learner recovery replaces
`roles.learners`. Every other reader only reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import Recipe
    from .async_loop.step import StreamPosition
    from .async_loop.stream import RolloutStream
    from .data import PromptStream
    from .items import PromptItem
    from .roles.handles import Roles
    from .samplers import Sampler


@dataclass
class Run:
    """What a step may use: the recipe, the run folder, the resolved model folder, the
    running roles and the training data (prompts, or preference pairs for DPO).

    Attributes:
        prompts: rollout algorithms: the prompt stream, `train.prompts_per_step` prompts
            per `next()`; with `train.max_staleness ≥ 1` the producer owns the stream and
            this is its `StreamPosition` (what a checkpoint saves). None otherwise.
        stream: `train.max_staleness ≥ 1`: the producer (recipes/async_loop/stream.py).
        sampler: synchronous rollout steps: chosen once (recipes/samplers.py).
    """

    recipe: Recipe
    run_dir: Path
    model_path: str
    roles: Roles
    data: list[Any]
    prompts: PromptStream | StreamPosition | None = None
    eval_prompts: list[PromptItem] | None = None
    stream: RolloutStream | None = None
    sampler: Sampler | None = None
