"""Where a learner rank runs: its device, the group's backend and rendezvous address,
and its CUDA memory. Plain torch; Ray is consulted only when the rank lives in a Ray
actor (its node's address, the GPUs Ray assigned it).

Rendezvous: rank 0 reports `rendezvous_address()` (its node's IP as Ray sees it and a
port free on that node); the controller hands the same `tcp://IP:PORT` to every rank,
so ranks on different nodes form one group. Outside Ray (tests, scripts/gpu_check.py)
the address is 127.0.0.1.

Device: on `cuda` Ray sets `CUDA_VISIBLE_DEVICES` to the GPU(s) it assigned the actor,
so the rank's GPU is always local index 0 (`cuda:0`); two colocated actors given the
same GPU (0.5 each) both see it as `cuda:0`.
"""

from __future__ import annotations

import os
import socket

import torch

MiB = 1 << 20


def node_ip() -> str:
    """This node's IP as Ray reports it inside a Ray worker, else 127.0.0.1."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    if not ray.is_initialized():
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def free_port_on(host: str) -> int:
    """A TCP port free on `host` (all interfaces when it is not loopback) right now."""
    bind = "127.0.0.1" if host.startswith("127.") else "0.0.0.0"
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def rendezvous_address() -> str:
    """`tcp://IP:PORT` for the learner group, made on rank 0's node."""
    ip = node_ip()
    return f"tcp://{ip}:{free_port_on(ip)}"


def where() -> dict[str, str]:
    """This process's place: `node_ip`, `node_id` (Ray's, '' outside Ray), `gpus`
    (CUDA_VISIBLE_DEVICES as Ray set it, '' on CPU) and `address`, a learner-group
    rendezvous on this node (`tcp://IP:PORT`)."""
    node_id = ""
    try:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return {
        "node_ip": node_ip(),
        "node_id": node_id,
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "address": rendezvous_address(),
    }


def backend_for(device: str) -> str:
    """The process-group backend of `device`: gloo on 'cpu'; on 'cuda' NCCL for CUDA
    tensors plus gloo for the few CPU tensors the learner reduces (token counts, metric
    sums), so both kinds of collective work on one group.

    Raises:
        ValueError: an unknown device.
    """
    if device == "cpu":
        return "gloo"
    if device == "cuda":
        return "cpu:gloo,cuda:nccl"
    raise ValueError(f"resources.device {device!r}: use 'cpu' or 'cuda'")


def rank_device(device: str) -> torch.device:
    """The torch device of this rank, made current (see the module docstring).

    Raises:
        RuntimeError: device 'cuda' in a process that sees no GPU (the message names
            CUDA_VISIBLE_DEVICES and the actor's GPU request).
    """
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise RuntimeError(
            "resources.device is 'cuda' but this learner process sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch "
            f"{torch.__version__}); install a CUDA build of torch and give the actor num_gpus"
        )
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    return dev


def format_cuda_memory(report: dict[str, float]) -> str:
    """One console line of `cuda_memory`'s keys in a report, or '' when it has none."""
    if "cuda_peak_mb" not in report:
        return ""
    return (
        f"learner CUDA memory (rank 0): allocated {report['cuda_allocated_mb']:.0f} MiB, "
        f"reserved {report['cuda_reserved_mb']:.0f} MiB, peak {report['cuda_peak_mb']:.0f} MiB"
    )


def cuda_memory(device: torch.device) -> dict[str, float]:
    """CUDA memory of this process on `device`, MiB: `cuda_allocated_mb` (tensors now),
    `cuda_reserved_mb` (held by the caching allocator), `cuda_peak_mb` (most allocated
    since start). Empty on CPU."""
    if device.type != "cuda":
        return {}
    return {
        "cuda_allocated_mb": torch.cuda.memory_allocated(device) / MiB,
        "cuda_reserved_mb": torch.cuda.memory_reserved(device) / MiB,
        "cuda_peak_mb": torch.cuda.max_memory_allocated(device) / MiB,
    }
