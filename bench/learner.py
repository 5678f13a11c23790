"""The learner against this machine's limit: the bf16 and fp32 matmul peak at the model's
projection shapes, and the FLOP/s the learner reaches on an SFT, a GRPO and a DPO train
step of the real model, with each step split into forward, backward, optimizer,
collectives and the rest, side by side in one run for each CPU layout.

    .venv/bin/python bench/learner.py [--steps 3] [--layouts 1x2,2x1]
        [--allocators jemalloc,system] [--smoke]

Model: SmolLM2-135M-Instruct (the built-in model), held as the learner holds it
(`LearnerWorker`: float32 master weights, bf16 compute by FSDP2 mixed precision, gloo).
Layouts `RxT`: R learner ranks (processes) of T torch threads each; the default
compares one rank with every core against one rank per core. The ranks run on the
learner's own malloc (`posttrain run` preloads jemalloc into CPU learners,
common/process.py `cpu_allocator_env`); `--allocators jemalloc,system` runs each
layout once per allocator, glibc's malloc as the before.

Workloads (the same code path as a recipe's step: `LearnerWorker.train_step`):
- sft: 16 conversations of recipes/sft_tool_arith.yaml, packed into 1024-token rows as
  its learner gets them, assistant-only loss, micro_batch_size 4 (the recipe's).
- grpo: 32 rows x (160 prompt + 64 response) random tokens, on-policy (one pass),
  micro_batch_size 16 (bench/learner_layout.py's GSM8K shape).
- dpo: 8 pairs x (96 + 64) tokens, reference sums precomputed, micro_batch_size 4.
- grpo_quickstart: recipes/quickstart_grpo.yaml's shape: 4 prompts of 40 random tokens x
  8 samples (a group's rows share the prompt, so the learner packs each group behind
  one copy of it, the groups end to end without padding), responses of 1..32 real
  tokens right-padded to 32, micro_batch_size 16.
- "sft, attention by block mask": sft again with each packed row's attention over the
  whole row under a block-diagonal mask (`segment_attention`), the learner's before of
  attention per conversation (`learner/attention.py` `segment_sdpa`).
- "sft, LM head on every token": sft again with the LM head run on every column from
  `response_start` on (the system prompt, the question and the tool's output too), the
  learner's before of running it on the loss's tokens only (`sequence_logprobs(...,
  wanted=response_mask)`).
- "sft, SDPA's attention backward": sft again with each conversation's attention
  differentiated by SDPA's CPU flash kernel, the learner's before of the matmul backward
  (`learner/attention.py` `causal_attention`).
- "sft, packed rows with their padding": sft again with the packed rows run as they
  are padded (3 rows x 856 columns for 2296 real tokens), the learner's before of
  laying them end to end without padding (`learner/packing.py` `PaddingFree`).
- "sft, weights kept forward->backward": sft again with FSDP2 not resharding the
  layers' weights after forward (`set_reshard_after_forward(False)`: no second
  all-gather in backward, the unsharded bf16 weights held meanwhile).
- "sft, foreach AdamW": sft again with torch's default AdamW (foreach, several
  weight-sized temporaries per step) in place of the learner's fused one
  (learner/optimizer.py `adamw`): the before and after of that change in one run.

Columns: s/step and tokens/s (real tokens of the step, all ranks): medians over
`--steps` steps after a warm-up step. GFLOP/s: the counted FLOPs of bench/_learner_work.py
(6·N_body·T + LM head on the logit tokens + attention) and, beside it, 6·N·T. % peak:
counted FLOP/s over the bf16 "model mix" matmul rate at every core (the FLOP-weighted
rate of one layer's projections and the LM head at 1024 rows). Split (rank 0's spans,
seconds of the median step): forward, backward, optimizer (clip + AdamW); collectives:
FSDP2's all-gathers and reduce-scatters and the all-reduces, from torch.profiler's
events of one extra step, scaled to the median step (they overlap forward and
backward, whose spans include them); other: the step less forward, backward and
optimizer (batch split, metric all-reduce, waiting on the other rank).

`--smoke`: a tiny random model, tiny batches, 1 step (checks the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.learner.ranks

import torch  # noqa: E402
from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _learner_work import (  # noqa: E402
    Shape,
    dpo_batch,
    grpo_batch,
    matmul_rate,
    quickstart_batch,
    sft_batch,
    step_flops,
)
from _smoke import SMOKE_HELP, tiny_model  # noqa: E402

from posttrain.common.model_registry import resolve_model_path  # noqa: E402

WORKLOADS = ("sft", "grpo", "dpo", "grpo_quickstart")
FOREACH = "sft, foreach AdamW"
KEPT = "sft, weights kept forward->backward"
MASKED = "sft, attention by block mask"
HEAD_ALL = "sft, LM head on every token"
SDPA_BWD = "sft, SDPA's attention backward"
PADDED = "sft, packed rows with their padding"
#: The SFT rows of earlier changes' befores (`--no-extras` skips them).
EXTRAS = [HEAD_ALL, MASKED, SDPA_BWD, PADDED]
COLLECTIVES = ("all_gather", "reduce_scatter", "allreduce", "all_reduce", "gloo:")


def _extra_rows(a: dict) -> list[str]:
    """The SFT rows this run adds after its workloads, in order (`--no-extras`,
    `--no-foreach` leave theirs out)."""
    return (list(EXTRAS) if a["extras"] else []) + ([KEPT, FOREACH] if a["foreach"] else [])


@contextmanager
def _allocator(name: str) -> Iterator[None]:
    """This process's environment while ranks are spawned: '' the learner's own
    (`cpu_allocator_env`, as `posttrain run` starts its ranks), 'jemalloc' that
    forced, 'system' glibc's malloc."""
    from posttrain.common.process import ALLOCATOR_ENV, cpu_allocator_env

    saved = dict(os.environ)
    if name == "system":
        os.environ.pop("LD_PRELOAD", None)
        os.environ[ALLOCATOR_ENV] = "system"
    elif name in ("", "jemalloc"):
        os.environ.pop(ALLOCATOR_ENV, None)
        env = cpu_allocator_env("cpu")
        if name == "jemalloc" and not env:
            raise SystemExit("--allocators jemalloc: no jemalloc library found")
        os.environ.update(env)
    else:
        raise SystemExit(f"--allocators: {name!r} is neither jemalloc nor system")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _workload(name: str, a: dict, world: int):  # noqa: ANN202
    """(batch, algorithm, loss settings, micro_batch_size) of workload `name`."""
    from posttrain.algorithms.dpo import DPOLoss
    from posttrain.algorithms.grpo import GRPOLoss
    from posttrain.algorithms.sft import SFTLoss

    if name == "sft":
        return sft_batch(a["model"], a["conversations"], world), "sft", SFTLoss(), 4
    if name == "grpo":
        b = grpo_batch(a["vocab"], a["rows"], a["prompt"], a["response"])
        return b, "grpo", GRPOLoss(), a["grpo_micro_batch"]
    if name == "grpo_quickstart":
        b = quickstart_batch(a["vocab"], a["qs_prompts"], 8, a["qs_prompt"], a["qs_longest"])
        return b, "grpo", GRPOLoss(), 16
    return dpo_batch(a["vocab"], a["pairs"], a["dpo_prompt"], a["response"]), "dpo", DPOLoss(), 4


class _Padded:
    """`PaddingFree`'s stand-in for the before of padding-free rows: the same call on
    the padded `[B, T]` rows (padding runs computed, never read)."""

    @staticmethod
    def build(input_ids, segment_ids, start):  # noqa: ANN001, ANN205
        from posttrain.learner.packing import PaddingFree, segment_positions, segment_runs

        b, t = segment_ids.shape
        cols = torch.arange(start - 1, t - 1).expand(b, -1)
        rows = torch.arange(b)[:, None].expand(b, t - start)
        real = (segment_ids[:, start:] > 0) & (segment_ids[:, start - 1 : -1] > 0)
        runs = segment_runs(segment_ids)
        return PaddingFree(input_ids, segment_positions(segment_ids), runs, rows, cols, real)


def _every_token(head, *args, wanted=None, **kwargs):  # noqa: ANN001, ANN202, ARG001
    """`head` (sequence_logprobs_and_entropy) with `wanted` dropped: the LM head on every
    column from `response_start` on, as before it ran on the loss's tokens only."""
    return head(*args, **kwargs)


def _collective_seconds(prof) -> float:  # noqa: ANN001
    """Wall seconds of the profiled step inside collective ops (top-level events only:
    a collective's own children are not counted twice)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if any(c in e.name.lower() for c in COLLECTIVES)
    )
    total, end = 0.0, -1.0
    for s, e in spans:  # the union of the intervals, in microseconds
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e6


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block (C++ logging bypasses sys.stderr)."""
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)


def _measure(w, shard, steps: int) -> list[dict]:  # noqa: ANN001
    """`steps` + 1 train steps (the first a warm-up) then one profiled: each step's wall
    seconds and rank 0's span seconds by kind; the last dict holds the profiled step."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for i in range(steps + 2):
        w.spans.drain()
        prof = profile(activities=[ProfilerActivity.CPU]) if i == steps + 1 else None
        t0 = time.time()
        if prof is not None:
            with prof, _quiet_stderr():  # kineto prints a line per start and stop
                w.train_step(shard, i)
        else:
            w.train_step(shard, i)
        rec = {"step": time.time() - t0}
        for sp in w.spans.drain():
            rec[sp.kind] = rec.get(sp.kind, 0.0) + sp.seconds
        if prof is not None:
            rec["collectives"] = _collective_seconds(prof)
        if i > 0:
            out.append(rec)
    return out


def _rank(rank: int, world: int, a: dict, port: int, queue) -> None:  # noqa: ANN001
    from dataclasses import replace

    from posttrain.algorithms import loss_module
    from posttrain.learner import attention, logprobs, worker
    from posttrain.learner.attention import sdpa_causal
    from posttrain.learner.worker import LearnerSettings, LearnerWorker

    s = LearnerSettings(model_path=a["model"], compute_dtype="bfloat16", lr=1e-5)
    w = LearnerWorker(rank, world, s, threads=a["threads"])
    w.setup(port)
    named = list(w.policy.named_parameters())
    n_all = sum(p.numel() for _, p in named)
    n_body = sum(p.numel() for n, p in named if ".layers." in n or n.endswith("model.norm.weight"))
    results = {}
    for name in a["workloads"]:
        batch, algo, loss, mbs = _workload(name, a, world)
        w.algo = loss_module(algo)  # one group, three losses: the models stay loaded
        w.s = replace(s, algorithm=algo, loss=loss, micro_batch_size=mbs)
        shape = Shape.of(a["config"])
        flops, six_nt = step_flops(batch, shape, n_body, n_all)
        results[name] = {
            "steps": _measure(w, batch.shard(rank, world), a["steps"]),
            "tokens": float(batch.attention_mask.sum()),
            "flops": flops,
            "six_nt": six_nt,
        }
    extras = _extra_rows(a)
    if extras:  # the SFT step again: attention by block mask (the before of attention
        # per conversation), FSDP2 keeping the layers' weights from forward to backward,
        # then with the AdamW the learner had before (foreach)
        batch, algo, loss, mbs = _workload("sft", a, world)
        w.algo, w.s = loss_module(algo), replace(s, algorithm=algo, loss=loss, micro_batch_size=mbs)
        for name in extras:
            flops, six_nt = step_flops(batch, Shape.of(a["config"]), n_body, n_all)
            apart, head = logprobs._segments_apart, worker.sequence_logprobs_and_entropy
            attend, free = attention.causal_attention, logprobs.PaddingFree
            if name == HEAD_ALL:
                worker.sequence_logprobs_and_entropy = partial(_every_token, head)
            elif name == MASKED:
                logprobs._segments_apart = lambda *_: False
            elif name == SDPA_BWD:
                attention.causal_attention = sdpa_causal
            elif name == PADDED:
                logprobs.PaddingFree = _Padded
            elif name == FOREACH:
                w.policy.set_reshard_after_forward(True)  # back to the learner's setting
                trained = [p for p in w.policy.parameters() if p.requires_grad]
                w.optimizers[0] = torch.optim.AdamW(trained, lr=s.lr, foreach=True)
            else:
                w.policy.set_reshard_after_forward(False)
            try:
                results[name] = {
                    "steps": _measure(w, batch.shard(rank, world), a["steps"]),
                    "tokens": float(batch.attention_mask.sum()),
                    "flops": flops,
                    "six_nt": six_nt,
                }
            finally:
                logprobs._segments_apart, worker.sequence_logprobs_and_entropy = apart, head
                attention.causal_attention, logprobs.PaddingFree = attend, free
    w.close()
    if rank == 0:
        buf = io.BytesIO()
        torch.save(results, buf)
        queue.put(buf.getvalue())


def _row(name: str, layout: str, res: dict, peak: float) -> str:
    timed, prof = res["steps"][:-1], res["steps"][-1]
    med = statistics.median(r["step"] for r in timed)
    part = {k: statistics.median(r.get(k, 0.0) for r in timed) for k in ("forward", "backward")}
    part["optimizer"] = statistics.median(r.get("optimizer", 0.0) for r in timed)
    coll = prof.get("collectives", 0.0) / prof["step"] * med
    other = max(0.0, med - sum(part.values()))
    rate = res["flops"] / med
    return (
        f"| {name} | {layout} | {med:.2f} | {res['tokens']:.0f} | {res['tokens'] / med:.0f} "
        f"| {rate / 1e9:.0f} | {res['six_nt'] / med / 1e9:.0f} | {100 * rate / peak:.0f}% "
        f"| {part['forward']:.2f} | {part['backward']:.2f} | {part['optimizer']:.2f} "
        f"| {coll:.2f} | {other:.2f} |"
    )


def _peak_table(shape: Shape, rows: int, cores: int, secs: float) -> float:
    """Print the matmul table; return the bf16 'model mix' rate at every core."""
    print(f"\nmatmul peak, F.linear at {rows} rows, GFLOP/s (best of repeats)\n")
    names = [*shape.projections(), "model mix"]
    print("| dtype | threads | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    peak = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        for threads in sorted({1, cores}):
            r = matmul_rate(shape, rows, dtype, threads, secs)
            cells = " | ".join(f"{r[n] / 1e9:.0f}" for n in names)
            print(f"| {str(dtype).split('.')[-1]} | {threads} | {cells} |")
            if dtype == torch.bfloat16 and threads == cores:
                peak = r["model mix"]
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layouts", default="", help="e.g. 1x2,2x1 (default: 1xC,Cx1)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--no-foreach",
        action="store_true",
        help="skip the SFT row with torch's default (foreach) AdamW, the learner's before",
    )
    ap.add_argument(
        "--no-extras",
        action="store_true",
        help="skip the SFT rows of earlier changes (LM head on every token, block mask, "
        "SDPA's attention backward)",
    )
    ap.add_argument(
        "--allocators",
        default="",
        help="e.g. jemalloc,system: each layout's rows once per malloc of the ranks "
        "(default: the learner's own, common/process.py cpu_allocator_env)",
    )
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    a = {"steps": args.steps, "workloads": args.workloads.split(","), "conversations": 16}
    a["foreach"] = "sft" in a["workloads"] and not args.no_foreach
    a["extras"] = "sft" in a["workloads"] and not args.no_extras
    a |= {"rows": 32, "prompt": 160, "response": 64, "grpo_micro_batch": 16}
    a |= {"pairs": 8, "dpo_prompt": 96, "qs_prompts": 4, "qs_prompt": 40, "qs_longest": 32}
    if args.smoke:
        a["model"], label, rows, secs = str(tiny_model()), "tiny random Llama (smoke)", 64, 0.05
        a |= {"steps": 1, "conversations": 4, "rows": 4, "prompt": 8, "response": 4}
        a |= {"grpo_micro_batch": 2, "pairs": 2, "dpo_prompt": 8}
        a |= {"qs_prompts": 2, "qs_prompt": 8, "qs_longest": 6}
    else:
        a["model"], label = str(resolve_model_path("smollm2-135m-instruct")), "SmolLM2-135M"
        rows, secs = 1024, 0.5
    a["config"] = json.loads((Path(a["model"]) / "config.json").read_text())
    a["vocab"] = a["config"]["vocab_size"]
    shape = Shape.of(a["config"])
    layouts = [f"1x{cores}", f"{cores}x1"] if not args.smoke else ["2x1"]
    layouts = args.layouts.split(",") if args.layouts else layouts
    print(header())
    peak = _peak_table(shape, rows, cores, secs)
    from tests.learner.ranks import run_ranks

    print(
        f"\n{label} learner, bf16 compute; medians of {a['steps']} step(s) after a warm-up; "
        f"% peak: counted GFLOP/s over the bf16 model-mix matmul rate at {cores} threads "
        f"({peak / 1e9:.0f} GFLOP/s); split: seconds of rank 0's median step\n"
    )
    print(
        "| workload | layout | s/step | tokens/step | tokens/s | GFLOP/s counted | GFLOP/s 6NT "
        "| % peak | forward | backward | optimizer | collectives | other |"
    )
    print("|---" * 13 + "|", flush=True)
    for lay, alloc in itertools.product(layouts, args.allocators.split(",")):
        world, threads = (int(x) for x in lay.split("x"))
        with _allocator(alloc):  # the ranks are spawned: they start with this environment
            res = run_ranks(_rank, world, {**a, "threads": threads}, timeout_s=3600.0)
        where = f"{world} rank(s) x {threads} thread(s)" + (f", {alloc}" if alloc else "")
        for name in [*a["workloads"], *_extra_rows(a)]:
            print(_row(name, where, res[name], peak), flush=True)
    print(f"\nload average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    main()
