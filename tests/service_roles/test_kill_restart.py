"""A real `posttrain serve` process killed with SIGKILL after step 5 of an SDK loop that
saved state there, and started again on the same root: its sessions are listed again,
the same training client runs steps 6-10, and the adapter and AdamW state end bit for
bit as those of an uninterrupted 10-step run; a request in flight at the kill is
answered 410 Gone (the SDK's retryable "promise expired"), and no process of the killed
service (its Ray head, raylet, learner and engine workers) outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

tinker = pytest.importorskip("tinker")

from tests.service.conftest import TOKEN  # noqa: E402
from tests.service_roles.steps import step  # noqa: E402

HEADERS = {"X-API-Key": TOKEN}


def _start(config: Path, root: Path, log: Path, port: int = 0) -> tuple[subprocess.Popen, str]:
    """`posttrain serve` in a new session (its own process group) on `port` (0: a free
    one); its URL once it listens."""
    env = {**os.environ, "POSTTRAIN_SERVE_TOKEN": TOKEN, "TINKER_TELEMETRY": "0"}
    cmd = [sys.executable, "-m", "posttrain.recipes.cli", "serve", "--config", str(config)]
    cmd += ["--root", str(root), "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith("posttrain serve: http://"):
                return proc, line.split()[2]
        time.sleep(0.2)
    _kill(proc)
    pytest.fail(f"posttrain serve did not start:\n{log.read_text()[-3000:]}")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _alive_in_session(sid: int) -> list[str]:
    """Processes of session `sid` still running (zombies excluded: already dead)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        fields = text.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, session
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(text.split(")", 1)[0] + ")")
    return alive


def _no_orphans(sid: int) -> None:
    deadline = time.monotonic() + 60  # Ray workers exit on their own once the raylet is gone
    while (alive := _alive_in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"processes of the killed service still run: {alive}"


def _saved(root: Path, path: str) -> dict[str, torch.Tensor]:
    """The adapter and AdamW tensors of a `tinker://<model>/weights/<name>` state."""
    model, _, name = path.removeprefix("tinker://").split("/")
    folder = root / model / "weights" / name
    return {
        **load_file(folder / "adapter_model.safetensors"),
        **load_file(folder / "optimizer.safetensors"),
    }


def test_a_service_killed_after_step_5_continues_bit_for_bit(
    tiny_model: Path, tmp_path: Path
) -> None:
    root, config = tmp_path / "root", tmp_path / "serve.yaml"
    config.write_text(
        f"model: {{path: {tiny_model}, name: tiny, dtype: float32}}\n"
        "rollout: {engine: hf}\n"
        "resources: {learner: {gpus: 1}, rollout: {gpus: 1}}\n"
        "sessions: {max_rank: 16}\n"
    )
    proc, url = _start(config, root, tmp_path / "first.log")
    try:
        client = tinker.ServiceClient(base_url=url, api_key=TOKEN)
        whole = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
        for _ in range(10):
            step(whole)
        expected = whole.save_state("step-10").result().path
        part = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
        for _ in range(5):
            step(part)
        part.save_state("step-5").result()
        # sent, never polled: its answer dies with the process
        body = {"model_id": part.model_id, "adam_params": {"learning_rate": 1e-2}}
        pending = httpx.post(f"{url}/api/v1/optim_step", json=body, headers=HEADERS).json()
    finally:
        _kill(proc)
    _no_orphans(proc.pid)

    port = int(url.rsplit(":", 1)[1])  # the SDK's clients keep their URL
    proc, url = _start(config, root, tmp_path / "second.log", port)
    try:
        late = httpx.post(
            f"{url}/api/v1/retrieve_future",
            json={"request_id": pending["request_id"]},
            headers=HEADERS,
        )
        assert late.status_code == 410, late.text  # the SDK raises RetryableException
        assert "send it again" in late.json()["detail"]
        status = httpx.get(f"{url}/api/v1/status", headers=HEADERS).json()
        assert status["models"][part.model_id]["steps"] == 5  # listed, at its saved step
        for _ in range(5):
            step(part)
        got = _saved(root, part.save_state("step-10").result().path)
        want = _saved(root, expected)
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        client.close("success").result(timeout=30)  # its heartbeat stops with the test
    finally:
        _kill(proc)
    _no_orphans(proc.pid)
