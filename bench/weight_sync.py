"""Weight push from one learner to 2 rollout engines, each transport side by side, full
and delta, with a plain torch memcpy of the same bytes in the same run as the limit.

    .venv/bin/python bench/weight_sync.py [--repeats 3] [--dtype bfloat16]
        [--metrics RUN/metrics.jsonl]   # also: push share of a real step, per-step delta
        [--transports collective,object_store,filesystem] [--no-vllm] [--smoke]

SmolLM2-135M-Instruct (the built-in model). Every push goes through the run's own code
(`weightsync.publish` on the learner side, `update_weights` on the engine side), with
the proof of delivery (`verify_checksum`, on by default) checked after each push:
  transport: bytes into 2 receiver processes, each copying every tensor into its own
             preallocated copy (what an engine's load does at least);
  vLLM:      `RolloutWorker.update_weights` into 2 real vLLM engines (transport +
             vLLM's `reload_weights` + prefix-cache reset), as a training step does.
  full / delta: every push whole, or `weight_sync.delta` (changed elements only). The
             weights of push v+1 are push v's after one AdamW-like step at the
             quickstart's lr (each fp32 master weight moves by lr = 5e-6, random sign),
             cast to the engine dtype: the share of bf16 elements that change is printed
             (the real run's, per step, comes with --metrics).
GB/s counts the model's bytes once (both engines receive them); the limit is one memcpy
per engine, since each engine ends with its own copy. Median of --repeats after one
warm-up push (a delta row's warm-up is its full first push). The proof of delivery's
cost is timed alone: fingerprinting every pushed tensor once (what each engine does),
and fused into a copy of the same bytes (what the collective sender does). Each
collective row forms its own group on a new `GroupStore` (a store serves one group: a
second group on it would reach the first one's processes).
`--metrics RUN/metrics.jsonl`: a run's mean push share of a step and, per step, the
bytes pushed and the changed share (a run with `--set weight_sync.delta=true` shows the
delta's bytes).
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
from posttrain.weightsync import (  # noqa: E402
    Delivery,
    GroupStore,
    PushSource,
    TransportSettings,
    check_delivery,
    fingerprints,
    make_transport,
    publish,
)
from posttrain.weightsync.delta import DeltaReceiver, DeltaSender  # noqa: E402
from posttrain.weightsync.verify import FingerprintTap, copy_fingerprint  # noqa: E402

TRANSPORTS = ("collective", "object_store", "filesystem")
LR = 5e-6  # recipes/quickstart_grpo.yaml


class Sink:
    """A receiver holding its own copy of the model's tensors (and, for deltas, the
    copy a delta is applied to), accounting for what it got like an engine."""

    def __init__(self, rank: int, settings: TransportSettings, shapes: dict):
        torch.set_num_threads(1)
        self.rank, self.transport = rank, make_transport(settings, rank=rank)
        self.own = {n: torch.empty(s, dtype=d) for n, (s, d) in shapes.items()}
        self.delta = None
        self.delivered = Delivery(-1)

    def set_delta(self, on: bool) -> None:
        self.delta = DeltaReceiver() if on else None

    def update_weights(self, handle, step: int) -> int:
        stream = self.transport.receive(handle)
        if self.delta is not None:
            self.delta.check(handle.meta, handle.version, self.rank)
            stream = self.delta.decode(stream, handle.meta, handle.version)
        tap = FingerprintTap(stream) if handle.meta.get("verify") else None
        for name, t in tap if tap is not None else stream:
            self.own[name].copy_(t)
        if tap is not None:
            self.delivered = Delivery(handle.version, tap.seen, where="loaded")
        return handle.version

    def delivery(self) -> Delivery:
        return self.delivered


class BenchWorker(RolloutWorker):
    """A rollout worker whose delta receiver is switched on for the delta series only
    (a run with `weight_sync.delta: false` keeps no copy of the last push)."""

    def set_delta(self, on: bool) -> None:
        self.delta = DeltaReceiver() if on else None


def _versions(weights: dict, n: int, dtype: torch.dtype, seed: int = 0) -> list[dict]:
    """`n` pushes: fp32 masters stepped by +-LR each time, cast to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    master = {k: v.float().clone() for k, v in weights.items()}
    out = []
    for _ in range(n):
        for v in master.values():
            v.add_(LR * (torch.randint(0, 2, v.shape, generator=g) * 2 - 1))
        out.append({k: v.to(dtype) for k, v in master.items()})
    return out


def _push(sender, receivers, w: dict, version: int, delta, verify: bool) -> tuple[float, int]:
    """One push through `publish`, as the controller runs it: (s, bytes)."""
    t0 = time.perf_counter()
    layout = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in w.items()]
    gen = publish(
        sender,
        PushSource(iter(w.items()), layout),
        version,
        sender=True,
        verify=verify,
        delta=delta,
    )
    handle = next(gen)
    refs = [r.update_weights.remote(handle, version - 1) for r in receivers]
    sent = [x for x in gen if isinstance(x, Delivery)]  # delivers, then the account
    ray.get(refs)
    if verify:
        for i, got in enumerate(ray.get([r.delivery.remote() for r in receivers])):
            check_delivery(sent[0], got, i)
    return time.perf_counter() - t0, handle.num_bytes


def _receivers(mode: str, settings: TransportSettings, n: int, path: str, dtype: str, shapes):
    """`n` receiver actors (rank i + 1), which join the push group while constructed."""
    if mode == "transport":
        return [ray.remote(num_cpus=0)(Sink).remote(i + 1, settings, shapes) for i in range(n)]
    worker = ray.remote(num_cpus=0)(BenchWorker)
    return [worker.remote(i, EngineSettings("vllm", path, dtype), settings, 1) for i in range(n)]


def _row(kind: str, mode: str, args, path: str, versions: list[dict]) -> dict[str, tuple]:
    """`{series: (median s, bytes)}` of `kind` into `args.engines` receivers of `mode`:
    one group of receivers takes a full series of pushes without the proof of delivery,
    one with it, then a delta series (with it)."""
    settings = TransportSettings(
        kind, bucket_mb=64, timeout_s=300, directory=f"/dev/shm/posttrain-bench-{kind}"
    )
    store = None
    if kind == "collective":  # one group per store: a new one for every row
        store = GroupStore(args.engines + 1, 300)
        settings = replace(settings, group_address=store.address, group_world=args.engines + 1)
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in versions[0].items()}
    receivers = _receivers(mode, settings, args.engines, path, args.dtype, shapes)
    sender = make_transport(settings, rank=0)
    out = {}
    try:
        v = 0
        series = (("full, no proof", None, False), ("full", None, True))
        for label, delta, verify in (*series, ("delta", DeltaSender(), True)):
            ray.get([r.set_delta.remote(delta is not None) for r in receivers])
            runs = []
            for i in range(args.repeats + 1):  # the first push: warm-up (a delta's: full)
                v += 1
                runs.append(_push(sender, receivers, versions[i], v, delta, verify))
            out[label] = (
                statistics.median(s for s, _ in runs[1:]),
                statistics.median(b for _, b in runs[1:]),
            )
    finally:
        sender.close()
        for r in receivers:
            ray.kill(r)
        if store is not None:
            store.close()
    return out


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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    weights = _untied(dict(model.state_dict()))  # tied lm_head left out, as the learner sends
    versions = _versions(weights, args.repeats + 1, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    changed = [
        sum(int((a[k].view(-1) != b[k].view(-1)).sum()) for k in a)
        / sum(t.numel() for t in a.values())
        for a, b in zip(versions, versions[1:], strict=False)
    ]

    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in versions[0].values()])
    dst = torch.empty_like(src)
    memcpy = statistics.median(_time(lambda: dst.copy_(src)) for _ in range(max(3, args.repeats)))
    verify_s = statistics.median(
        _time(lambda: fingerprints(versions[0].items())) for _ in range(max(3, args.repeats))
    )
    # The collective sender's way: the hash fused into the bucket copy, against the copy.
    copy_s, fused_s = (
        statistics.median(_time(lambda f=f: _pack(versions[0], dst, f)) for _ in range(3))
        for f in (False, True)
    )
    enc = DeltaSender()
    enc.encode(versions[0], 1)
    encode_s = _time(lambda: enc.encode(versions[1], 2)) if len(versions) > 1 else 0.0

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    limit = memcpy * args.engines  # every engine needs its own copy of the bytes
    rows = []
    modes = ["transport"] if args.no_vllm else ["transport", "vLLM"]
    for kind in args.transports.split(","):
        for mode in modes:
            got = _row(kind, mode, args, path, versions)
            rows.extend((kind, mode, label_, s, b) for label_, (s, b) in got.items())
    ray.shutdown()

    print(header())
    print(
        f"\n{label} {args.dtype}: {nbytes / 1e6:.1f} MB to {args.engines} engines, median of "
        f"{args.repeats}; bf16 elements changed per push: "
        f"{', '.join(f'{100 * c:.2f}%' for c in changed)}\n"
    )
    print(f"| transport | into | push | seconds | MB sent | GB/s | vs memcpy x {args.engines} |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| torch memcpy, once | - | - | {memcpy:.3f} | {nbytes / 1e6:.1f} | "
        f"{nbytes / memcpy / 1e9:.2f} | - |"
    )
    print(f"| torch memcpy x {args.engines} (limit) | - | - | {limit:.3f} | - | - | 1.00x |")
    for kind, mode, push_, s, b in rows:
        print(
            f"| {kind} | {mode} | {push_} | {s:.3f} | {b / 1e6:.1f} | {nbytes / s / 1e9:.2f} | "
            f"{limit / s:.2f}x |"
        )
    secs = {(k, m, p): s for k, m, p, s, _ in rows}
    print(
        f"\nproof of delivery: fingerprinting {nbytes / 1e6:.1f} MB alone takes {verify_s:.3f} s "
        "per side; in the push (full vs full, no proof):"
    )
    for kind, mode, push_, s, _ in rows:
        if push_ == "full":
            bare = secs[(kind, mode, "full, no proof")]
            print(f"  {kind} into {mode}: {s - bare:+.3f} s = {100 * (s - bare) / bare:+.1f}%")
    print(
        f"fused into the collective sender's bucket copy (copy_fingerprint): copy {copy_s:.3f} s, "
        f"copy + hash {fused_s:.3f} s, so the learner's hash costs {fused_s - copy_s:+.3f} s"
    )
    print(f"delta encode on the learner (compare + index scan): {encode_s:.3f} s per push")
    if args.metrics:
        steps = [json.loads(x) for x in args.metrics.read_text().splitlines()]
        steps = [m for m in steps if "time/step" in m]
        step_s = statistics.mean(m["time/step"] for m in steps)
        sync_s = statistics.mean(m["time/weight_sync"] for m in steps)
        print(
            f"\n{args.metrics}: mean step {step_s:.1f} s, mean push (weight_sync) {sync_s:.2f} s "
            f"= {100 * sync_s / step_s:.1f}% of a step\n"
        )
        print("| step | weight_sync s | step s | share | MB pushed | vs full | changed |")
        print("|---|---|---|---|---|---|---|")
        for i, m in enumerate(steps, start=1):
            b = m.get("weight_sync_bytes", 0)
            print(
                f"| {i} | {m['time/weight_sync']:.2f} | {m['time/step']:.2f} | "
                f"{100 * m['time/weight_sync'] / m['time/step']:.1f}% | {b / 1e6:.1f} | "
                f"{100 * b / nbytes:.1f}% | "
                f"{100 * m.get('weight_sync_changed_fraction', 1.0):.2f}% |"
            )


def _pack(weights: dict, dst: torch.Tensor, fused: bool) -> None:
    """Every tensor's bytes into `dst` back to back; with `fused`, fingerprinted on the
    way (as the collective transport packs its buckets)."""
    at = 0
    for t in weights.values():
        n = t.numel() * t.element_size()
        if fused:
            copy_fingerprint(dst[at : at + n], t)
        else:
            dst[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
        at += n


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
