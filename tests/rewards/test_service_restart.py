"""A reward service that died comes back on its own port at once: its old connections
(left in FIN_WAIT / TIME_WAIT for about a minute after a crash) must not keep
`serve-rewards` or the run's local service from listening again, so the client's
retries and the controller's automatic restart find it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from posttrain.common.net import free_port
from posttrain.rewards.client import RewardClient, start_local_service
from posttrain.rewards.protocol import ScoreItem
from tests.conftest import ROOT

COMPONENTS = [{"name": "len", "type": "length", "target_chars": 4}]
ITEM = ScoreItem(uid="a", response="abcd")


def _serve_rewards(config, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain.recipes.cli", "serve-rewards", str(config)]
        + ["--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _kill_and_restart(start, port: int) -> None:
    """Score once (a kept-alive connection), SIGKILL the service, start it again on the
    same port at once, and score through the same client."""
    client = RewardClient(f"http://127.0.0.1:{port}/score", token="t", retries=0)
    first = start()
    try:
        client.wait_ready(timeout_s=60, proc=first)
        assert client.score([ITEM])[0].reward == 1.0
    finally:
        _stop(first)
    second = start()
    try:
        client.wait_ready(timeout_s=60, proc=second)  # exited 2 before: address in use
        assert client.score([ITEM])[0].reward == 1.0
    finally:
        _stop(second)
        client.close()


def test_serve_rewards_restarts_on_its_port_after_a_crash(tmp_path, monkeypatch):
    cfg = tmp_path / "rewards.yaml"
    cfg.write_text(json.dumps({"rewards": COMPONENTS, "token_env": "T"}))
    monkeypatch.setenv("T", "t")
    port = free_port()
    _kill_and_restart(lambda: _serve_rewards(cfg, port), port)


def test_local_service_restarts_on_its_port_after_a_crash(tmp_path):
    port = free_port()
    _kill_and_restart(
        lambda: start_local_service(json.dumps(COMPONENTS), port, "t", tmp_path / "log", 1), port
    )


def test_a_port_another_process_listens_on_is_still_refused(tmp_path):
    from posttrain.common.net import listen_socket

    cfg = tmp_path / "rewards.yaml"
    cfg.write_text(json.dumps({"rewards": COMPONENTS}))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(OSError):
            listen_socket("127.0.0.1", port)
        proc = _serve_rewards(cfg, port)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and f"127.0.0.1:{port}" in out.decode(), out
