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
import resource
import socket

import torch
import torch.distributed as dist

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


def memory_peaks(device: torch.device) -> dict[str, float]:
    """`learner_peak_rss_mb`: this process's peak resident memory, MiB; on GPUs also
    `learner_cuda_peak_mb`, the most CUDA memory its tensors held."""
    out = {"learner_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":  # ru_maxrss is KiB on Linux
        out["learner_cuda_peak_mb"] = cuda_memory(device)["cuda_peak_mb"]
    return out


def step_sums(
    sums: dict[str, float], real: int, computed: int, entropy: list[float], lm: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """Sum a step's per-rank loss sums and token counts over the learner group (one
    float64 all-reduce; every rank passes the same keys). Collective.

    Args:
        sums: this rank's loss sums by key (the algorithm's `LossOutput.sums`).
        real, computed: this rank's non-padding and computed (padded) tokens.
        entropy: [Σ entropy over this rank's response tokens, their count].
        lm: a causal LM (report `entropy`).

    Returns:
        (the summed `sums`, {`padding_fraction`, and `entropy`: the mean over the step's
        response tokens of all ranks}).
    """
    keys = sorted(sums)  # the same keys, in the same order, on every rank
    total = torch.tensor([sums[k] for k in keys] + [real, computed, *entropy], dtype=torch.float64)
    dist.all_reduce(total)
    *summed, real_all, computed_all, entropy_sum, entropy_tokens = total.tolist()
    shape = {"padding_fraction": 1.0 - real_all / computed_all}
    if lm:
        shape["entropy"] = entropy_sum / max(entropy_tokens, 1.0)
    return dict(zip(keys, summed, strict=True)), shape
