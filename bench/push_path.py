"""The learner's side of a CPU weight push, part by part: FSDP2 ranks (gloo, 1 thread
each) holding a synthetic model of SmolLM2-135M's 272 tensor shapes (269 MB in bf16,
random values, nothing loaded or downloaded) hand rank 0 the full tensors, which rank 0
packs into 64 MiB buckets as the collective transport does.

    python bench/push_path.py [--ranks 2] [--repeats 3] [--smoke]

Rows (median of --repeats after one warm-up, seconds on rank 0):
  gather, all-gathers:   FSDP2's per-parameter `full_tensor()` after the cast to bf16,
                         what `weight_sync.shm_gather: false` does (gloo, loopback TCP);
  gather, shared memory: `learner/shm_gather.py`, `weight_sync.shm_gather: true`;
  pack:                  copying every tensor into bucket buffers;
  pack + fingerprint:    the same copy with the proof of delivery's hash fused into it
                         (`weightsync.verify.copy_fingerprint`, what the sender does),
                         into buffers kept from push to push (weightsync/collective.py);
  pack + fingerprint into new buffers: the same into buffers allocated for each push
                         (what the collective transport did before: fresh pages fault
                         on first touch; an engine's receive buffers did the same);
  fingerprint alone:     the hash as a separate pass (what the engine side does).
The transport's send and the engine's load are in bench/weight_sync.py and
bench/weight_load.py.
`--smoke`: a 2-layer, 64-wide model, one repeat (checks the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP  # noqa: E402

from posttrain.common.net import free_port  # noqa: E402
from posttrain.learner.push import untied_state  # noqa: E402
from posttrain.learner.shm_gather import ShmGather  # noqa: E402
from posttrain.weightsync.buckets import bucket_layout  # noqa: E402
from posttrain.weightsync.verify import copy_fingerprint, fingerprints  # noqa: E402

#: SmolLM2-135M: hidden, intermediate, key/value width, layers, vocabulary.
SMOL = (576, 1536, 192, 30, 49152)
SMOKE = (64, 128, 32, 2, 512)


def _model(dims: tuple[int, ...]) -> torch.nn.Module:
    """Random parameters of a Llama's shapes, one submodule per decoder layer."""
    h, inter, kv, layers, vocab = dims
    g = torch.Generator().manual_seed(0)

    def p(*shape):
        return torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)

    model = torch.nn.Module()
    model.embed = p(vocab, h)
    model.layers = torch.nn.ModuleList()
    for _ in range(layers):
        m = torch.nn.Module()
        for name, shape in (
            ("q", (h, h)),
            ("k", (kv, h)),
            ("v", (kv, h)),
            ("o", (h, h)),
            ("gate", (inter, h)),
            ("up", (inter, h)),
            ("down", (h, inter)),
            ("ln1", (h,)),
            ("ln2", (h,)),
        ):
            setattr(m, name, p(*shape))
        model.layers.append(m)
    model.norm = p(h)
    return model


def _median(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, dims, repeats: int, port: int, queue) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = _model(dims)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = untied_state(model)
    bf16 = torch.bfloat16

    def all_gathers():
        return [(n, t.detach().to(bf16).full_tensor()) for n, t in state.items()]

    gather = ShmGather.create(state, rank, world, bf16)
    out = {
        "gather, all-gathers": _median(all_gathers, repeats),
        "gather, shared memory": _median(lambda: list(gather.stream(state)), repeats),
    }
    full = dict(gather.stream(state))  # collective; only rank 0 gets tensors
    if rank == 0:
        layout = bucket_layout(full, 64 << 20)
        bufs = [torch.empty(b["size"], dtype=torch.uint8) for b in layout]

        def pack(fused: bool, new: bool = False):
            into = [torch.empty(b["size"], dtype=torch.uint8) for b in layout] if new else bufs
            for buf, bucket in zip(into, layout, strict=True):
                for name, _, _, offset, nbytes in bucket["entries"]:
                    dst, t = buf[offset : offset + nbytes], full[name]
                    if fused:
                        copy_fingerprint(dst, t)
                    else:
                        dst.copy_(t.reshape(-1).view(torch.uint8))

        out["pack"] = _median(lambda: pack(False), repeats)
        out["pack + fingerprint"] = _median(lambda: pack(True), repeats)
        out["pack + fingerprint into new buffers"] = _median(lambda: pack(True, True), repeats)
        out["fingerprint alone"] = _median(lambda: fingerprints(full.items()), repeats)
        out["bytes"] = sum(t.numel() * t.element_size() for t in full.values())
        out["tensors"] = len(full)
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put(buf.getvalue())
    dist.barrier()
    queue.close()
    queue.join_thread()
    os._exit(0)  # gloo's threads can abort a finalising interpreter (tests/learner/ranks.py)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    dims, label = (SMOKE, "tiny (smoke)") if args.smoke else (SMOL, "SmolLM2-135M's shapes")
    repeats = 1 if args.smoke else args.repeats
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.ranks, dims, repeats, port, queue))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    out = torch.load(io.BytesIO(queue.get(timeout=600)), weights_only=False)
    for p in procs:
        p.join(timeout=60)
    print(header())
    print(
        f"\n{label}, synthetic: {out['bytes'] / 1e6:.1f} MB in bf16, {out['tensors']} tensors, "
        f"{args.ranks} gloo ranks x 1 thread, median of {repeats}\n"
    )
    print("| part (learner rank 0) | seconds | GB/s |")
    print("|---|---|---|")
    for key in (
        "gather, all-gathers",
        "gather, shared memory",
        "pack",
        "pack + fingerprint",
        "pack + fingerprint into new buffers",
        "fingerprint alone",
    ):
        print(f"| {key} | {out[key]:.3f} | {out['bytes'] / out[key] / 1e9:.2f} |")


if __name__ == "__main__":
    main()
