"""The learner's logprob pass with full-vocabulary logits against the chunked LM head
(learner/logprobs.py), side by side: time and peak memory of one training
forward/backward and of one no-grad forward.

    .venv/bin/python bench/logprobs.py [--rows 16] [--prompt 160] [--response 64]
        [--repeats 2] [--threads 2] [--smoke]

SmolLM2-135M-Instruct (the built-in model) as the learner holds it: FSDP2 (one gloo
rank), float32 master weights, bf16 compute. The default shape is one micro-batch of
the GSM8K workload of issue 15 (16 rows × 160 prompt + 64 response tokens). Each
variant runs in its own process (peak RSS is per process), in the order full, chunked,
full, chunked, ...; "peak over base" is the peak resident memory (VmHWM, reset after
loading the model and one warm-up pass) minus the resident memory at that point, so it
is what the logprob passes themselves add (in training that includes the gradients:
bf16 unsharded and float32 sharded, about 0.8 GB for this model, in both variants).
Times are medians over `--repeats` (and rounds): wall seconds and, beside them, the
process's CPU seconds (user + system over all its threads), which other jobs on a
shared machine disturb much less than wall time. `--smoke`: a tiny random model, 2 rows
x (8 + 4) tokens, one repeat (checks the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

from _header import header  # bench/ is sys.path[0] when a bench runs
from _smoke import SMOKE_HELP, tiny_model

from posttrain.common.model_registry import resolve_model_path


def _status_mb(key: str) -> float:
    """A `/proc/self/status` memory line (VmRSS: now, VmHWM: peak since reset), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _variant(chunk: int | None, args: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from posttrain.common.net import free_port
    from posttrain.learner.logprobs import sequence_logprobs
    from posttrain.learner.models import load_sharded

    torch.set_num_threads(args["threads"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    model = load_sharded(args["model"], 1, "bfloat16", "policy")
    g = torch.Generator().manual_seed(0)
    width = args["prompt"] + args["response"]
    ids = torch.randint(0, args["vocab"], (args["rows"], width), generator=g)
    mask = torch.ones_like(ids)
    adv = torch.randn(args["rows"], width, generator=g)

    def train() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        out = sequence_logprobs(model, ids, mask, args["prompt"], 1.0, chunk)
        (out * adv).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    def forward() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            sequence_logprobs(model, ids, mask, args["prompt"], 1.0, chunk)
        return time.perf_counter() - t0, time.process_time() - c0

    train()  # warm-up: allocator and FSDP buffers
    base = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak (VmHWM) := now
    tr = [train() for _ in range(args["repeats"])]
    fw = [forward() for _ in range(args["repeats"])]
    peak = _status_mb("VmHWM")
    dist.destroy_process_group()
    queue.put(
        {
            "train": statistics.median(t for t, _ in tr),
            "train_cpu": statistics.median(c for _, c in tr),
            "forward": statistics.median(t for t, _ in fw),
            "forward_cpu": statistics.median(c for _, c in fw),
            "peak_over_base_mb": peak - base,
            "base_mb": base,
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=160)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="full/chunked pairs of processes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512, help="chunk_tokens of the chunked run")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        args.model, args.label = str(tiny_model()), "tiny random Llama (smoke)"
        args.rows, args.prompt, args.response, args.repeats, args.rounds = 2, 8, 4, 1, 1
        args.threads, args.chunk = 1, 4
    else:
        args.model, args.label = str(resolve_model_path("smollm2-135m-instruct")), "SmolLM2-135M"
    args.vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    ctx = mp.get_context("spawn")
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    results: dict[str, list[dict]] = {"full logits": [], f"chunked ({args.chunk})": []}
    for _ in range(args.rounds):
        for name, chunk in zip(results, (None, args.chunk), strict=True):
            queue = ctx.Queue()
            p = ctx.Process(target=_variant, args=(chunk, vars(args), queue))
            p.start()
            results[name].append(queue.get(timeout=1800))
            p.join()
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    logits_gb = args.rows * (args.response) * args.vocab * 4 / 1e9
    print(header())
    print(
        f"\n{args.label}, FSDP2 1 rank x {args.threads} threads, bf16 compute: "
        f"{args.rows} rows x ({args.prompt} + {args.response}) tokens "
        f"(fp32 response logits would be {logits_gb:.2f} GB); medians of {args.repeats} "
        f"x {args.rounds} round(s)\n"
    )
    print(
        "| logprobs | train fwd+bwd s (CPU s) | no-grad fwd s (CPU s) | peak over base MiB "
        "| train CPU vs full |"
    )
    print("|---|---|---|---|---|")
    base = None
    for name, runs in results.items():
        v = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        base = base or v
        print(
            f"| {name} | {v['train']:.2f} ({v['train_cpu']:.2f}) | {v['forward']:.2f} "
            f"({v['forward_cpu']:.2f}) | {v['peak_over_base_mb']:.0f} "
            f"| {v['train_cpu'] / base['train_cpu']:.2f}x |"
        )
    print(f"\nload average before: {' '.join(load0)}; after: {' '.join(load1)}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
