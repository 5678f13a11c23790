"""A two-node Ray cluster on this machine (two `ray start`, one declared GPU each) runs
the quickstart shape (GRPO, collective weight push, 2 learner ranks) colocated on a tiny
model with `posttrain run --address`: the colocated placement group needs both nodes'
GPUs, so learner rank 0 and rank 1 land on different Ray nodes and must form one
learner group through rank 0's node address (not 127.0.0.1)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from posttrain.common.net import free_port

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# Ray enables token auth by default for `ray start`; a throwaway local cluster opts out
# (every process of the test: nodes, the readiness probe, the driver).
ENV = {
    **os.environ,
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
BIN = Path(sys.executable).parent


def _ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


def _start_node(tmp: Path, name: str, head: str | None, ray_tmp: Path) -> subprocess.Popen:
    """`ray start --block` for one node (its own ports, temp dir, one CPU and one
    declared GPU); the caller stops it by its process group."""
    nm, om, agent_l, agent_g, rt, metrics, client = _ports(7)
    lo = 20000 + (os.getpid() % 200) * 100 + (0 if head is None else 50)
    args = [
        *RAY,
        "start",
        "--block",
        "--num-cpus",
        "1",
        "--num-gpus",
        "1",
        "--resources",
        json.dumps({name: 1}),
        "--object-store-memory",
        str(200 << 20),
        "--node-manager-port",
        str(nm),
        "--object-manager-port",
        str(om),
        "--dashboard-agent-listen-port",
        str(agent_l),
        "--dashboard-agent-grpc-port",
        str(agent_g),
        "--runtime-env-agent-port",
        str(rt),
        "--metrics-export-port",
        str(metrics),
        "--min-worker-port",
        str(lo),
        "--max-worker-port",
        str(lo + 49),
        "--disable-usage-stats",
    ]
    if head is None:
        args += [
            "--head",
            "--port",
            head_port_of(tmp),
            "--include-dashboard",
            "false",
            "--ray-client-server-port",
            str(client),
            "--temp-dir",
            str(ray_tmp),
        ]
    else:
        args += ["--address", head]
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=ENV,
    )


def head_port_of(tmp: Path) -> str:
    f = tmp / "head_port"
    if not f.exists():
        f.write_text(str(free_port()))
    return f.read_text()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM `ray start --block` (it stops what it started), then SIGKILL its process
    group's leftovers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_nodes(address: str, n: int, timeout_s: float = 90) -> None:
    code = (
        "import ray,time,sys\n"
        f"ray.init(address='{address}', log_to_driver=False)\n"
        f"end = time.time() + {timeout_s}\n"
        f"while sum(x['Alive'] for x in ray.nodes()) < {n} and time.time() < end:\n"
        "    time.sleep(1)\n"
        f"sys.exit(0 if sum(x['Alive'] for x in ray.nodes()) >= {n} else 1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=timeout_s + 60, env=ENV)


@pytest.fixture
def two_nodes(tmp_path):
    """The head's address of a two-node local cluster, torn down afterwards."""
    # Ray's socket paths must stay under 108 bytes: a short temp dir, not tmp_path.
    ray_tmp = Path(tempfile.mkdtemp(prefix="pt2n", dir="/tmp"))
    procs = [_start_node(tmp_path, "node_a", None, ray_tmp)]
    try:
        import ray

        address = f"{ray.util.get_node_ip_address()}:{head_port_of(tmp_path)}"
        deadline = time.time() + 60
        while not list(ray_tmp.glob("session_*/logs/gcs_server.out")):
            assert procs[0].poll() is None, (tmp_path / "node_a.log").read_text()[-2000:]
            assert time.time() < deadline, "the head node did not start"
            time.sleep(0.5)
        procs.append(_start_node(tmp_path, "node_b", address, ray_tmp))
        _wait_nodes(address, 2)
        yield address
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_learner_ranks_on_two_nodes_form_one_group(two_nodes, tiny_model, tmp_path):
    recipe = {
        "name": "two-node",
        "algorithm": "grpo",
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {"train": {"generator": "arithmetic", "size": 20, "seed": 1}},
        "rollout": {"engine": "hf", "samples_per_prompt": 4, "max_new_tokens": 6},
        "rewards": [  # the length reward gives groups signal on a random model
            {"name": "correct", "type": "math"},
            {"name": "short", "type": "length", "target_chars": 3, "weight": 0.5},
        ],
        "train": {"steps": 2, "prompts_per_step": 3, "micro_batch_size": 2, "lr": 1e-3},
        "resources": {
            "rollout": {"gpus": 1},
            "learner": {"gpus": 2},
            "colocate": True,
            "threads_per_worker": 1,
        },
        "weight_sync": {"type": "collective", "verify_checksum": True},
        "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
    }
    recipe_file = tmp_path / "two_node.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    env = ENV
    done = subprocess.run(
        [
            str(BIN / "posttrain"),
            "run",
            str(recipe_file),
            "--address",
            two_nodes,
            "--out",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    cluster = json.loads((run_dir / "cluster.json").read_text())
    ranks = cluster["learner_ranks"]
    assert len(ranks) == 2 and ranks[0]["node_id"] != ranks[1]["node_id"]
    host = cluster["learner_group"].removeprefix("tcp://").rsplit(":", 1)[0]
    assert host == ranks[0]["node_ip"] and not host.startswith("127.")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in lines] == [1, 2]
    assert all(m["grad_norm"] > 0 for m in lines)
    assert (run_dir / "final" / "config.json").is_file()
