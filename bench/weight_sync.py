"""Weight push from one learner to 2 rollout engines, each transport side by side, with
a plain torch memcpy of the same bytes in the same run as the limit.

    .venv/bin/python bench/weight_sync.py [--repeats 3] [--dtype bfloat16]
        [--metrics RUN/metrics.jsonl]   # also: push time as a share of a real step
        [--transports collective,object_store,filesystem] [--no-vllm] [--smoke]

SmolLM2-135M-Instruct (the built-in model). Two measurements per transport:
  transport: bytes into 2 receiver processes, each copying every tensor into its own
             preallocated copy (what an engine's load does at least);
  vLLM:      `update_weights` into 2 real vLLM engines (transport + vLLM's
             `reload_weights` + prefix-cache reset), as a training step does.
GB/s counts the model's bytes once (both engines receive them); the limit is one memcpy
per engine, since each engine ends with its own copy. Median of --repeats after one
warm-up push. Each collective row forms its own group on a new `GroupStore` (a store
serves one group: a second group on it would reach the first one's processes).
`--smoke`: a tiny random model (vLLM-sized), one engine, one push after the warm-up
(checks the bench runs; tests/bench/).
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
from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP, tiny_model  # noqa: E402

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


def _receivers(mode: str, settings: TransportSettings, n: int, path: str, dtype: str, shapes):
    """`n` receiver actors (rank i + 1), which join the push group while constructed."""
    if mode == "transport":
        return [ray.remote(num_cpus=0)(Sink).remote(i + 1, settings, shapes) for i in range(n)]
    worker = ray.remote(num_cpus=0)(RolloutWorker)
    return [worker.remote(i, EngineSettings("vllm", path, dtype), settings, 1) for i in range(n)]


def _row(kind: str, mode: str, args, path: str, weights: dict) -> float:
    """Median push seconds of `kind` into `args.engines` receivers of `mode`."""
    settings = TransportSettings(
        kind, bucket_mb=64, timeout_s=300, directory=f"/dev/shm/posttrain-bench-{kind}"
    )
    store = None
    if kind == "collective":  # one group per store: a new one for every row
        store = GroupStore(args.engines + 1, 300)
        settings = replace(settings, group_address=store.address, group_world=args.engines + 1)
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
    receivers = _receivers(mode, settings, args.engines, path, args.dtype, shapes)
    sender = make_transport(settings, rank=0)
    try:
        runs = _push_seconds(sender, receivers, weights, args.repeats + 1)[1:]  # warm-up
    finally:
        sender.close()
        for r in receivers:
            ray.kill(r)
        if store is not None:
            store.close()
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true", help="transport rows only")
    ap.add_argument("--metrics", type=Path, help="a run's metrics.jsonl: report push / step")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.smoke:
        path, label = str(tiny_model(vllm=True)), "tiny random Llama (smoke)"
        args.repeats, args.engines = 1, 1
    else:
        path, label = str(resolve_model_path("smollm2-135m-instruct")), "SmolLM2-135M"
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    weights = _untied(dict(model.state_dict()))  # tied lm_head left out, as the learner sends
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])
    dst = torch.empty_like(src)
    memcpy = statistics.median(_time(lambda: dst.copy_(src)) for _ in range(max(3, args.repeats)))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = [
        ("torch memcpy, once", "-", memcpy),
        (f"torch memcpy x {args.engines} (limit)", "-", memcpy * args.engines),
    ]
    limit = memcpy * args.engines  # every engine needs its own copy of the bytes
    modes = ["transport"] if args.no_vllm else ["transport", "vLLM"]
    for kind in args.transports.split(","):
        for mode in modes:
            rows.append((kind, mode, _row(kind, mode, args, path, weights)))
    ray.shutdown()

    print(header())
    print(
        f"\n{label} {args.dtype}: {nbytes / 1e6:.1f} MB to {args.engines} engines, "
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
