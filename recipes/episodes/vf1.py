"""A verifiers 0.4 (`verifiers.v1`) environment as posttrain episodes
(`rollout.environment: {type: verifiers, api: v1}`), on posttrain's black-box agent
path (agent_step.py): each step, vf1_driver.py runs the step's episodes with verifiers
itself (its harness, its rubric) in `rollout.environment.python`, every model call of
its harness sampled and recorded token-exactly by a rollout worker's OpenAI-compatible
endpoint (actors/openai_server.py, agent.py), and posts each episode's reward: the
trace's weighted reward sum, each `@vf.reward` score a component. The prompts:
recipes/data/vf1_tasks.py.

The driver stays up between steps (`Drivers.run_step`, the driver's `serve` verb):
importing verifiers and loading the taskset take seconds of CPU, once per run instead of
once per step. `Drivers` is a role of the run (`Roles.vf1_drivers`,
recipes/roles/handles.py): started at the run's first verifiers v1 step, stopped by
`stop_roles` on every exit (a finished run, an error, a signal; `posttrain eval` too).
A driver also exits by itself when this process goes (its standard input closes). A
step past `step_timeout_s`, or a driver that exits, fails that step and stops that
driver; the next step starts a new one.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

from ...config.episodes import VerifiersEnvironment
from ..data.vf1_tasks import driver_command
from .vf1_driver import DONE  # its module level is the standard library only


class DriverFailed(RuntimeError):
    """The driver exited, or ran past its step's timeout (the message says which)."""


class WarmDriver:
    """One driver process (`vf1_driver.py serve`) running step after step."""

    def __init__(self, command: list[str], log: Path) -> None:
        with open(log, "a") as err:  # until the first step names its own log
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,  # its own group: a stop ends what it started
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None  # noqa: S101 - Popen(stdout=PIPE)
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def step(self, episodes: Path, log: Path, timeout_s: float) -> None:
        """Run the episodes of `episodes`, the driver's messages going to `log`.

        Raises:
            DriverFailed: the driver exited, or the step ran past `timeout_s`.
        """
        assert self.proc.stdin is not None  # noqa: S101 - Popen(stdin=PIPE)
        try:
            self.proc.stdin.write(json.dumps({"episodes": str(episodes), "log": str(log)}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise DriverFailed(f"the driver exited {self.proc.poll()}") from e
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DriverFailed(f"ran past its timeout ({timeout_s:g} s)") from None
            if line is None:
                raise DriverFailed(f"the driver exited {self.proc.wait()}")
            if line == DONE:
                return
            with open(log, "a") as out:  # whatever else it printed
                out.write(line + "\n")

    def stop(self) -> None:
        """End the driver and everything it started (idempotent)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                if self.proc.poll() is None:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()


class Drivers:
    """The warm drivers of one run, one per driver command (see the module docstring).

    Concurrency: thread-safe; one step at a time per driver (a second caller waits)."""

    def __init__(self) -> None:
        self._drivers: dict[str, WarmDriver] = {}
        self._lock = threading.Lock()

    def running(self) -> list[WarmDriver]:
        """The drivers held now (tests, benches)."""
        with self._lock:
            return list(self._drivers.values())

    def run_step(self, cfg: VerifiersEnvironment, episodes: Path, log: Path) -> None:
        """Run a step's episode file on the warm driver of `cfg` (started if there is none).

        Raises:
            DriverFailed: see `WarmDriver.step`; that driver is then stopped.
        """
        command = driver_command(cfg, "serve")
        key = json.dumps(command)
        with self._lock:
            driver = self._drivers.get(key)
            if driver is None or driver.proc.poll() is not None:
                driver = self._drivers[key] = WarmDriver(command, log)
            try:
                driver.step(episodes, log, cfg.step_timeout_s)
            except DriverFailed:
                driver.stop()
                self._drivers.pop(key, None)
                raise

    def stop(self) -> None:
        """Stop every driver held (idempotent)."""
        with self._lock:
            for driver in self._drivers.values():
                driver.stop()
            self._drivers.clear()
