"""Weight push from one learner to 2 rollout engines, each transport side by side, with
a plain torch memcpy of the same bytes in the same run as the limit.

    .venv/bin/python bench/weight_sync.py [--repeats 3] [--dtype bfloat16]
        [--metrics RUN/metrics.jsonl]   # also: push time as a share of a real step

SmolLM2-135M-Instruct (the built-in model). Two measurements per transport:
  transport: bytes into 2 receiver processes, each copying every tensor into its own
             preallocated copy (what an engine's load does at least);
  vLLM:      `update_weights` into 2 real vLLM engines (transport + vLLM's
             `reload_weights` + prefix-cache reset), as a training step does.
GB/s counts the model's bytes once (both engines receive them); the limit is one memcpy
per engine, since each engine ends with its own copy. Median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from posttrain.actors.engine import EngineSettings  # noqa: E402
from posttrain.actors.worker import RolloutWorker  # noqa: E402
from posttrain.common.model_registry import resolve_model_path  # noqa: E402
from posttrain.learner.push import untied as _untied  # noqa: E402
from posttrain.weightsync import GroupStore, TransportSettings, make_transport  # noqa: E402

TRANSPORTS = ("collective", "object_store", "filesystem")


class Sink:
    """A receiver holding its own copy of the model's tensors."""

    def __init__(self, rank: int, settings: TransportSettings, shapes: dict):
        torch.set_num_threads(1)
        self.rank, self.transport = rank, make_transport(settings, rank=rank)
        self.own = {n: torch.empty(s, dtype=d) for n, (s, d) in shapes.items()}

    def update_weights(self, handle, step: int) -> int:
        for name, t in self.transport.receive(handle):
            self.own[name].copy_(t)
        return handle.version


def _push_seconds(sender, receivers, weights, repeats) -> list[float]:
    runs = []
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        handle = sender.send(weights, v)
        ray.get([r.update_weights.remote(handle, v - 1) for r in receivers])
        sender.finish(handle)
        runs.append(time.perf_counter() - t0)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true", help="transport rows only")
    ap.add_argument("--metrics", type=Path, help="a run's metrics.jsonl: report push / step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = str(resolve_model_path("smollm2-135m-instruct"))
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    weights = _untied(dict(model.state_dict()))  # tied lm_head left out, as the learner sends
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}

    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])
    dst = torch.empty_like(src)
    memcpy = statistics.median(_time(lambda: dst.copy_(src)) for _ in range(max(3, args.repeats)))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = [
        ("torch memcpy, once", "-", memcpy),
        (f"torch memcpy x {args.engines} (limit)", "-", memcpy * args.engines),
    ]
    limit = memcpy * args.engines  # every engine needs its own copy of the bytes
    for kind in TRANSPORTS:
        settings = TransportSettings(
            kind, bucket_mb=64, timeout_s=300, directory=f"/dev/shm/posttrain-bench-{kind}"
        )
        store = None
        if kind == "collective":  # receivers join the push group while constructed
            store = GroupStore(args.engines + 1, 300)
            settings = replace(settings, group_address=store.address, group_world=args.engines + 1)
        modes = [
            (
                "transport",
                lambda i, s=settings: ray.remote(num_cpus=0)(Sink).remote(i + 1, s, shapes),
            )
        ]
        if not args.no_vllm:
            modes.append(
                (
                    "vLLM",
                    lambda i, s=settings: ray.remote(num_cpus=0)(RolloutWorker).remote(
                        i, EngineSettings("vllm", path, args.dtype), s, 1
                    ),
                )
            )
        for mode, start in modes:
            receivers = [start(i) for i in range(args.engines)]
            sender = make_transport(settings, rank=0)
            runs = _push_seconds(sender, receivers, weights, args.repeats + 1)[1:]  # warm
            rows.append((kind, mode, statistics.median(runs)))
            sender.close()
            for r in receivers:
                ray.kill(r)
    ray.shutdown()

    print(
        f"\nSmolLM2-135M {args.dtype}: {nbytes / 1e6:.1f} MB to {args.engines} engines, "
        f"median of {args.repeats}\n"
    )
    print(f"| transport | into | seconds | GB/s | vs memcpy x {args.engines} |")
    print("|---|---|---|---|---|")
    for kind, mode, s in rows:
        gbps = nbytes / s / 1e9
        print(f"| {kind} | {mode} | {s:.3f} | {gbps:.2f} | {limit / s:.2f}x |")
    if args.metrics:
        steps = [json.loads(x) for x in args.metrics.read_text().splitlines()]
        step_s = statistics.mean(m["time/step"] for m in steps)
        sync_s = statistics.mean(m["time/weight_sync"] for m in steps)
        print(
            f"\n{args.metrics}: mean step {step_s:.1f} s, mean push (weight_sync) {sync_s:.2f} s "
            f"= {100 * sync_s / step_s:.1f}% of a step"
        )


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
