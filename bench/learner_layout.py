"""The CPU learner's layout, side by side: one FSDP2 rank owning every core against one
rank per core (each with one thread), on the same batch.

    .venv/bin/python bench/learner_layout.py [--steps 3] [--rows 32] [--prompt 160]
        [--response 64] [--micro-batch 16] [--smoke]

SmolLM2-135M-Instruct (the built-in model) as the learner holds it (float32 master
weights, bf16 compute, FSDP2 over gloo), `--steps` optimizer steps of a GRPO-shaped
update: per micro-batch the response logprobs (learner/logprobs.py), a policy-gradient
surrogate `-(A · logprob)` token-mean over the whole batch, backward; then gradient
clipping and AdamW. The default shape is the GSM8K workload of issue 15 (8 prompts ×
4 samples sharing their prompt, 64 new tokens, `micro_batch_size` 16); the quickstart's is
`--rows 32 --prompt 40 --response 24 --samples 8`. Rows are split evenly over the
ranks, as the controller does. Times are medians over the steps after the first; the
layouts alternate when `--rounds` > 1. `--smoke`: a tiny random model, 4 rows x (8 + 4)
tokens, 2 steps (checks the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.learner.ranks

from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP, tiny_model  # noqa: E402

from posttrain.common.model_registry import resolve_model_path  # noqa: E402


def _rank(rank: int, world: int, args: dict, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from posttrain.learner.logprobs import sequence_logprobs
    from posttrain.learner.models import load_sharded

    torch.set_num_threads(args["threads"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = load_sharded(args["model"], world, "bfloat16", "policy")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    width = args["prompt"] + args["response"]
    ids = torch.randint(0, args["vocab"], (args["rows"], width), generator=g)
    for first in range(0, args["rows"], args["samples"]):  # a group shares its prompt
        ids[first : first + args["samples"], : args["prompt"]] = ids[first, : args["prompt"]]
    adv = torch.randn(args["rows"], 1, generator=g).expand(-1, width)
    mine = torch.arange(args["rows"]).chunk(world)[rank]
    denom = args["rows"] * args["response"]  # token-mean over the whole step
    times = []
    for _ in range(args["steps"]):
        t0 = time.perf_counter()
        for rows in mine.split(args["micro_batch"]):
            lp = sequence_logprobs(model, ids[rows], torch.ones_like(ids[rows]), args["prompt"])
            loss = -(adv[rows] * lp).sum() / denom
            (loss * world).backward()  # FSDP2 averages over ranks: make it the sum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 0:
        buf = io.BytesIO()
        torch.save(times, buf)
        queue.put(buf.getvalue())


def _layout(world: int, threads: int, args: argparse.Namespace) -> list[float]:
    from tests.learner.ranks import run_ranks  # spawned ranks, rank 0's result

    return run_ranks(_rank, world, {**vars(args), "threads": threads})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=160)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument(
        "--samples",
        type=int,
        default=4,
        help="rows per group, sharing one prompt (the learner packs them)",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        args.model, args.label = str(tiny_model()), "tiny random Llama (smoke)"
        args.steps, args.rows, args.prompt, args.response, args.micro_batch = 2, 4, 8, 4, 2
        args.samples, args.rounds = 2, 1
    else:
        args.model, args.label = str(resolve_model_path("smollm2-135m-instruct")), "SmolLM2-135M"
    args.vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    cores = os.cpu_count() or 1
    layouts = {f"1 rank x {cores} threads": (1, cores), f"{cores} ranks x 1 thread": (cores, 1)}
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    runs: dict[str, list[float]] = {k: [] for k in layouts}
    for _ in range(args.rounds):
        for name, (world, threads) in layouts.items():
            runs[name] += _layout(world, threads, args)[1:]
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    print(header())
    print(
        f"\n{args.label} learner step, {args.rows} rows x ({args.prompt} + {args.response}) "
        f"tokens, micro-batch {args.micro_batch} rows per rank; median of steps 2..{args.steps}"
        f" x {args.rounds} round(s)\n"
    )
    print("| layout | s/step | vs first |")
    print("|---|---|---|")
    first = None
    for name, ts in runs.items():
        med = statistics.median(ts)
        first = first or med
        print(f"| {name} | {med:.2f} | {med / first:.2f}x |")
    print(f"\nload average before: {' '.join(load0)}; after: {' '.join(load1)}")


if __name__ == "__main__":
    main()
