"""Recovering a run from a dead learner rank (recipes/loop.py calls it when a step
fails with a Ray actor or task error), and stopping one cleanly: after a twice-failed
weight push (`stop_after_failed_push`) or a signal (`StopOnSignal`, `RunStopped`), each
after a checkpoint.

A learner rank that dies (`kill -9`, out of memory, a crashed node) leaves its FSDP
group broken: the other ranks' collectives fail, and a gloo or NCCL group cannot take a
new process. So the whole learner group is replaced, never one rank:

1. the dead rank is confirmed (a Ray `RayActorError` from a cheap call on it; an error
   with every rank alive is not a learner death and is raised as it was);
2. with `train.max_restarts` used up (default 0) the run stops with `LearnerDied`,
   naming the newest complete checkpoint and the command that resumes it;
3. otherwise every learner actor is killed and a new group starts on the same
   placement, loading the newest complete checkpoint (`setup(resume_from=...)`); with no
   checkpoint yet it starts from the initial weights and the run goes back to step 0.
   The prompt stream, the controller's RNGs and the logs go back to that step too
   (steps logged after it are dropped and run again; under `train.max_staleness` ≥ 1
   the producer stops, its groups are discarded, and a new one starts from the
   checkpoint's data position and its pending prompts, so each prompt still trains
   once), the algorithm's `prepare` runs
   again (DPO: the reference sums, from its cache), a collective transport forms a new
   broadcast group, and that policy is pushed to every engine as its `policy_version`.
   Counted in `roles.counters.learner_restarts` (metric `learner_restarts`).

Not thread-safe: the controller's thread alone calls it, between steps.
"""

from __future__ import annotations

import random
import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from tqdm import tqdm

from . import checkpoints
from . import controller as c
from .data import prompt_stream
from .monitoring.log import StepLog
from .state import Run

if TYPE_CHECKING:
    from .algo.base import Algorithm

# Errors a step can end with when a learner rank died: the dead actor's own call
# (RayActorError) or a surviving rank's collective that lost its peer (RayTaskError).
STEP_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError)


class LearnerDied(RuntimeError):
    """A learner rank died and `train.max_restarts` allows no (more) restarts; the
    message names the newest complete checkpoint and how to resume."""


def dead_learners(learners: list[Any], timeout_s: float = 30.0) -> list[int]:
    """Ranks whose actor is dead: a no-op call on each fails with `RayActorError`
    (a rank still busy after `timeout_s` seconds counts as alive)."""
    refs = [lw.__ray_ready__.remote() for lw in learners]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    dead = []
    for rank, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead.append(rank)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError):
            pass
    return dead


def last_good(run_dir: Path, step: int) -> Path | None:
    """The newest complete checkpoint of `run_dir` made after at most `step` steps whose
    files match its manifest (`checkpoints.verify`; a damaged one is skipped, saying
    so)."""
    found = [p for p in checkpoints.complete(run_dir) if int(p.name[5:]) <= step]
    for ckpt in reversed(found):
        try:
            checkpoints.verify(ckpt)
        except checkpoints.CheckpointDamaged as e:
            tqdm.write(f"checkpoint {ckpt.name} is damaged ({e}); trying the one before")
            continue
        return ckpt
    return None


class LearnerRecovery:
    """Restarts the learner group of a running `Run` (recipes/state.py) (see the module
    docstring). Make it before the first step: it keeps the controller's RNG state of
    that moment, for a restart from step 0."""

    def __init__(self, run: Run, algo: Algorithm, log: StepLog):
        self.run, self.algo, self.log = run, algo, log
        self.rng0 = (torch.get_rng_state(), random.getstate(), np.random.get_state())

    def after_error(self, step: int, error: BaseException) -> int:
        """Handle `error`, which ended step `step`; returns the step to continue from.

        Raises:
            BaseException: `error` itself when no learner rank is dead.
            LearnerDied: a rank is dead and no restart is left.
        """
        run, recipe = self.run, self.run.recipe
        dead = dead_learners(run.roles.learners)
        if not dead:
            raise error
        what = (
            f"learner rank {', '.join(map(str, dead))} died in step {step} ({type(error).__name__})"
        )
        ckpt = last_good(run.run_dir, step)
        if run.roles.counters.learner_restarts >= recipe.train.max_restarts:
            where = (
                f"Last good checkpoint: {ckpt}. Resume with: posttrain run --resume {run.run_dir}"
                if ckpt
                else "No checkpoint was written yet; start "
                f"again with: posttrain run {run.run_dir / 'recipe.yaml'} --out NEW_DIR"
            )
            raise LearnerDied(
                f"{what}; the run stopped after {run.roles.counters.learner_restarts} learner "
                f"restarts (train.max_restarts: {recipe.train.max_restarts}). {where} "
                "(train.max_restarts: N lets a run restart its learner group by itself)"
            ) from error
        tqdm.write(
            f"{what}; restarting the learner group from "
            f"{ckpt or 'the initial weights (no checkpoint yet)'}"
        )
        return self.restart(ckpt)

    def restart(self, ckpt: Path | None) -> int:
        """A new learner group from `ckpt` (None: the initial weights) with everything
        that goes with it (module docstring); returns the step it holds."""
        run, roles, recipe = self.run, self.run.roles, self.run.recipe
        for lw in roles.learners:
            ray.kill(lw, no_restart=True)
        transport = roles.specs.transport
        if roles.group is not None:  # the new rank 0 joins the new group below
            transport = replace(transport, group_address=None)
        saved = checkpoints.read_state(ckpt) if ckpt else None
        roles.learners = roles.specs.learners(transport, str(ckpt / "learner") if ckpt else None)
        start = saved["step"] if saved else 0
        if run.stream is not None:  # asynchronous loop: the next step starts a new producer
            run.stream.close()
            run.stream = None
        if run.prompts is not None:
            run.prompts = prompt_stream(
                run.data,
                recipe.train.prompts_per_step,
                recipe.data.shuffle_seed,
                saved and saved["data"],
            )
        if ckpt is not None:
            checkpoints.restore_controller_rng(ckpt)
        else:
            torch.set_rng_state(self.rng0[0])
            random.setstate(self.rng0[1])
            np.random.set_state(self.rng0[2])
        self.algo.prepare(run)
        if self.algo.uses_rollouts:
            if roles.group is not None:
                c.reform_push_group(roles, recipe)
            c.push_weights(roles, recipe, start)
            ray.get([a.drain_spans.remote() for a in roles.rollout + roles.learners])
        roles.counters.learner_restarts += 1
        self.log.rewind(start)
        tqdm.write(
            f"learner group restarted ({roles.counters.learner_restarts} of "
            f"{recipe.train.max_restarts}); continuing from step {start} "
            f"(policy_version {start})"
        )
        return start


class PushFailed(RuntimeError):
    """A weight push failed twice; the run stopped after a checkpoint."""


def stop_after_failed_push(run: Any, algo: Any, step: int, error: BaseException) -> PushFailed:
    """Recovers what a twice-failed weight push leaves: the learners trained step `step`
    but the engines still serve the old policy. A checkpoint after `step + 1` steps
    keeps that training (a resume pushes its policy to every engine first); the step's
    metrics line was written (`weight_push_failed: 1`) when it got to its push."""
    folder = checkpoints.save_run(run, algo, step + 1)
    return PushFailed(
        f"step {step}: {error}. Checkpoint {folder}; once the engine is "
        f"fixed, resume with: posttrain run --resume {run.run_dir}"
    )


class RunStopped(RuntimeError):
    """SIGTERM or Ctrl-C stopped the run after a step and its checkpoint, or during
    start-up (`starting=True`: nothing trained, nothing new saved; `steps_done` is the
    step a resume started from, 0 for a new run)."""

    def __init__(self, run_dir: Path, steps_done: int, signum: int, starting: bool = False):
        self.run_dir, self.steps_done, self.signum = run_dir, steps_done, signum
        name = signal.Signals(signum).name
        if not starting:
            message = (
                f"stopped by {name} after step {steps_done - 1}; checkpoint "
                f"{run_dir / checkpoints.FOLDER}/step_{steps_done:05d}. Resume with: "
                f"posttrain run --resume {run_dir}"
            )
        elif steps_done:
            message = (
                f"stopped by {name} during start-up, before step {steps_done}: nothing new "
                f"was trained or saved. Resume with: posttrain run --resume {run_dir}"
            )
        else:
            message = (
                f"stopped by {name} during start-up: nothing was trained or saved "
                f"(the run folder {run_dir} holds no checkpoint); run the same command again"
            )
        super().__init__(message)


class StopOnSignal:
    """While active (main thread only), the first SIGTERM or SIGINT is recorded in
    `signum` so the loop can finish its step and checkpoint (`starting`: so start-up can
    end and every role be stopped); a second SIGINT stops at once (KeyboardInterrupt).

    Enter it after `ray.init`, whose SIGTERM handler in the driver prints a native stack
    trace and exits (`SystemExit(15)`) wherever the driver is; this one replaces it.
    """

    def __init__(self, starting: bool = False) -> None:
        self.signum: int | None = None
        self.old: dict[int, Any] = {}
        self.starting = starting

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        then = (
            "stopping every role once start-up ends"
            if self.starting
            else ("finishing this step, then a checkpoint")
        )
        tqdm.write(
            f"{signal.Signals(signum).name}: {then} (Ctrl-C again stops at once, without one)"
        )

    def stop_if_signalled(self, run_dir: Path, steps_done: int) -> None:
        """Raise `RunStopped` (a start-up stop) if a signal came while starting.

        Raises:
            RunStopped: a signal was recorded.
        """
        if self.signum is not None:
            raise RunStopped(run_dir, steps_done, self.signum, starting=True)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
