"""The environment server a run starts itself (`rollout.environment.serve`,
config/env_server.py): one role like the local reward service, started by `start_roles`
(and `posttrain eval`) before the rollout workers and learners, stopped by `stop_roles`
on every exit (a finished run, an error, a signal, a failed start).

The server runs in its own session (process group): a Ctrl-C at the terminal reaches
posttrain, which finishes its step and then stops the server, instead of killing the
server under the step's episodes; stopping it signals the whole group, so a server that
runs its own workers leaves none behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx

from ...common.net import free_port
from ...config import Recipe
from ...config.env_server import PORT, EnvironmentServe

LOG_NAME = "environment_server.log"


@dataclass
class EnvironmentServer:
    """A running environment server: its process (a session leader), the URL the
    episodes reach it at (`{port}` filled), its log."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    log: IO[bytes]

    def log_tail(self, chars: int = 1500) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `timeout_s`; safe to
        call twice."""
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc, signal.SIGKILL)  # what its children left running
        self.log.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _listening(url: str) -> bool:
    """Whether something already answers TCP connections at `url`'s host and port."""
    parts = urlsplit(url)
    default = 443 if parts.scheme in ("https", "wss") else 80
    try:
        with socket.create_connection((parts.hostname or "", parts.port or default), 1.0):
            return True
    except OSError:
        return False


def launch(serve: EnvironmentServe, url: str, run_dir: Path) -> EnvironmentServer:
    """Start `serve.command` (not waited for), `{port}` in it and in `url` filled with
    one free port, its output to `run_dir/environment_server.log`.

    Raises:
        RuntimeError: `url` has a fixed port that another process already listens on
            (a server left running would answer in this run's place).
        RuntimeError: the program cannot be started (named).
    """
    port = str(free_port())
    url = url.replace(PORT, port)
    if _listening(url):
        raise RuntimeError(
            f"rollout.environment.url {url}: another process already listens there (a "
            f"server left running?), so the one rollout.environment.serve starts could not; "
            f"stop it, or use url: http://127.0.0.1:{PORT} for a free port"
        )
    argv = [a.replace(PORT, port) for a in serve.command]
    if argv[0] == "python":
        argv[0] = sys.executable
    log_path = run_dir / LOG_NAME
    log = open(log_path, "ab")  # noqa: SIM115 - kept open for the server's lifetime
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **serve.env}
    try:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    except OSError as e:
        log.close()
        raise RuntimeError(f"rollout.environment.serve.command {argv}: cannot start it: {e}") from e
    return EnvironmentServer(proc, url.rstrip("/"), log_path, log)


def wait_healthy(server: EnvironmentServer, serve: EnvironmentServe) -> None:
    """Block until `GET {url}{health_path}` answers 200.

    Raises:
        RuntimeError: the server exited first, or did not answer within
            `serve.ready_timeout_s`; the message ends with its log's tail.
    """
    health = server.url.replace("ws://", "http://").replace("wss://", "https://")
    health += serve.health_path
    deadline = time.monotonic() + serve.ready_timeout_s
    with httpx.Client(timeout=2.0) as http:
        while True:
            if server.proc.poll() is not None:
                why = f"exited with code {server.proc.returncode} before answering {health}"
                break
            try:
                if http.get(health).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                why = (
                    f"did not answer GET {health} with 200 within {serve.ready_timeout_s:g} s "
                    f"(rollout.environment.serve.ready_timeout_s)"
                )
                break
            time.sleep(0.2)
    raise RuntimeError(
        f"the environment server (rollout.environment.serve.command {serve.command}) {why}; "
        f"its log ({server.log_path}) ends:\n{server.log_tail()}"
    )


def start_environment_server(roles: Any, recipe: Recipe, run_dir: Path) -> None:
    """Start the recipe's environment server when `rollout.environment.serve` asks for
    one, into `roles.env_server` before waiting for it (so the caller's `stop_roles`
    stops it if the wait fails or is interrupted), and wait until it is healthy.

    Raises:
        RuntimeError: it did not start or become healthy (see `launch`, `wait_healthy`).
    """
    env = recipe.rollout.environment
    serve = getattr(env, "serve", None)
    if serve is None:
        return
    roles.env_server = launch(serve, env.url, run_dir)
    print(
        f"environment server: {' '.join(roles.env_server.proc.args)} at {roles.env_server.url} "
        f"(log: {roles.env_server.log_path})",
        flush=True,
    )
    wait_healthy(roles.env_server, serve)
