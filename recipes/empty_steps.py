"""Steps with nothing to train on: no response token of the step's batch counts in the
loss (every sample's scoring failed and `on_reward_failure` left it out, every group
was dropped, every response masked). AdamW would still move every weight on such a
step (its momentum and weight decay act without a gradient), so none is taken:

- `train_or_skip` (the rollout steps, `recipes.loop.rl_step` and
  `recipes.async_loop.async_step`): the algorithm's `train`, or, for a batch without a
  response token, no call to the learners at all; the step reports `empty_step` 1 and
  `empty_step_cause` in its metrics (0 and no cause on a step that trained). A step
  whose every mini-batch is empty after the algorithm's own masking
  (`grpo.mask_truncated`) takes no optimizer step either (`run_updates` skips empty
  mini-batches) and is reported the same way.
- `EmptySteps` (the loop, after each step): prints every empty step on the console,
  and after `train.max_empty_steps` of them in a row writes a checkpoint and stops the
  run with `NothingToTrain`, naming the cause (a reward service that is down fails
  every step the same way; training on would only burn time).

The weight push still runs after an empty step (same weights, the next
policy_version), so checkpoints keep `policy_version == steps done`.

Not thread-safe: the controller's thread alone calls these, once per step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from ..actors.rollout import Rollout
from ..algorithms.batch import TrainBatch
from ..rewards.protocol import Score
from . import checkpoints
from .state import Run

if TYPE_CHECKING:
    from .algo.base import Algorithm, RLAlgorithm


class NothingToTrain(RuntimeError):
    """`train.max_empty_steps` steps in a row had nothing to train on; the run stopped
    after a checkpoint. The message names the cause, the checkpoint and how to resume."""


def empty_cause(
    rollouts: list[Rollout], scores: list[Score], rewards: list[float | None], policy: str
) -> str:
    """Why a step's batch holds no response token to train on, for the console and
    `empty_step_cause`: the failed scores (with the first error), the groups that
    `on_reward_failure` (`policy`) dropped, or masked responses."""
    n, failed = len(rollouts), [s for s in scores if s.reward is None]
    left_out = sum(r is None for r in rewards)
    if failed and len(failed) == n:
        return f"none of the {n} samples could be scored (first error: {failed[0].error})"
    if left_out == n:
        first = f"; first error: {failed[0].error}" if failed else ""
        return (
            f"on_reward_failure: {policy} left out every group ({len(failed)} of {n} "
            f"samples could not be scored{first})"
        )
    return f"no response token to train on in {n} samples (every response masked)"


def train_or_skip(
    algo: RLAlgorithm,
    learners: list[Any],
    batch: TrainBatch,
    rollouts: list[Rollout],
    rewards: list[float | None],
    scores: list[Score],
    step: int,
) -> dict[str, Any]:
    """`algo.train(learners, batch, rollouts, rewards, step)` plus `empty_step` 0, or
    for a batch without a response token (`batch.response_mask` all 0) no call to the
    learners: `empty_step` 1, its `empty_step_cause`, and zero train times. A training
    whose updates were all skipped (`updates` 0) is reported as empty too."""
    if float(batch.response_mask.sum()) == 0.0:
        cause = empty_cause(rollouts, scores, rewards, algo.recipe.on_reward_failure)
        return {
            "empty_step": 1.0,
            "empty_step_cause": cause,
            "time/logprobs": 0.0,
            "time/train": 0.0,
        }
    stats = algo.train(learners, batch, rollouts, rewards, step)
    if stats.get("updates") == 0.0:
        cause = "every mini-batch was left without a response token (grpo.mask_truncated?)"
        return {**stats, "empty_step": 1.0, "empty_step_cause": cause}
    return {**stats, "empty_step": 0.0}


class EmptySteps:
    """Counts the run's empty steps in a row (see the module docstring).

    Args:
        limit: `train.max_empty_steps` (None: never stop).
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self.in_a_row: list[int] = []

    def after_step(self, run: Run, algo: Algorithm, step: int, metrics: dict[str, Any]) -> None:
        """Note step `step` (its metrics as logged, `step + 1` steps done, any due
        checkpoint written).

        Raises:
            NothingToTrain: the limit was reached; a checkpoint after `step + 1` steps
                exists (written here unless one was due anyway).
        """
        if not metrics.get("empty_step"):
            self.in_a_row = []
            return
        self.in_a_row.append(step)
        cause = metrics.get("empty_step_cause", "")
        stop_at = f"stops after {self.limit} in a row" if self.limit else "never stops"
        tqdm.write(
            f"step {step}: nothing to train on, no optimizer step ({cause}); "
            f"{len(self.in_a_row)} such step(s) in a row (train.max_empty_steps: the run "
            f"{stop_at})"
        )
        if self.limit is None or len(self.in_a_row) < self.limit:
            return
        done = step + 1
        folder = Path(run.run_dir) / checkpoints.FOLDER / f"step_{done:05d}"
        if not (folder / checkpoints.STATE_FILE).is_file():
            t0 = time.time()
            folder = checkpoints.save_run(run, algo, done)
            tqdm.write(f"checkpoint: {folder} ({time.time() - t0:.1f} s)")
        first, last = self.in_a_row[0], self.in_a_row[-1]
        raise NothingToTrain(
            f"steps {first}-{last}: {len(self.in_a_row)} steps in a row had nothing to "
            f"train on (train.max_empty_steps: {self.limit}); the last: {cause}. No "
            f"optimizer step was taken in them. Checkpoint {folder}; once the cause is "
            "fixed (e.g. the reward service answers again), resume with: posttrain run "
            f"--resume {run.run_dir}"
        )
