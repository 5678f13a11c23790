"""The learner's training forward/backward eager against `torch.compile`d decoder
layers, side by side on this CPU: compile time (the first call) and steady-state time.

    .venv/bin/python bench/compile.py [--rows 16] [--prompt 160] [--response 64]
        [--repeats 3] [--threads 2] [--quickstart-steps N] [--skip-micro] [--smoke]

`--quickstart-steps N` also runs the quickstart (real model, vLLM, 2 learner ranks) for N
steps with `train.compile` off, then on, and prints the learner's train time per step:
the first step (which pays the compiles) and the median of the others.

SmolLM2-135M-Instruct as the learner holds it (FSDP2 on one gloo rank, float32 master
weights, bf16 compute, chunked LM-head logprobs). "compiled" wraps each decoder layer's
`forward` in `torch.compile` (inductor, C++ codegen on CPU) before sharding, as
torchtitan compiles per block, so FSDP2's hooks stay eager. Each variant runs in its own
process, eager first; times are medians over `--repeats` after the first call (wall
seconds, and CPU seconds of the process beside them). `--smoke`: a tiny random model,
2 rows x (8 + 4) tokens, one repeat, and with `--quickstart-steps` the quickstart shrunk
to it (checks the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

from _header import header  # bench/ is sys.path[0] when a bench runs
from _quiet import QUIET
from _smoke import SMOKE_HELP, tiny_model, tiny_run

from posttrain.common.model_registry import resolve_model_path


def _variant(compiled: bool, args: dict, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from posttrain.common.net import free_port
    from posttrain.learner.logprobs import sequence_logprobs

    torch.set_num_threads(args["threads"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    model.config.use_cache = False
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        if compiled:
            layer.forward = torch.compile(layer.forward)
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    g = torch.Generator().manual_seed(0)
    width = args["prompt"] + args["response"]
    ids = torch.randint(0, model.config.vocab_size, (args["rows"], width), generator=g)
    mask = torch.ones_like(ids)
    adv = torch.randn(args["rows"], width, generator=g)

    def train() -> tuple[float, float, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        out = sequence_logprobs(model, ids, mask, args["prompt"], 1.0)
        (out * adv).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0, time.process_time() - c0, float(out.sum()), float(norm))

    first, first_cpu, logprob_sum, grad_norm = train()
    runs = [train() for _ in range(args["repeats"])]
    dist.destroy_process_group()
    queue.put(
        {
            "first": first,
            "first_cpu": first_cpu,
            "train": statistics.median(r[0] for r in runs),
            "train_cpu": statistics.median(r[1] for r in runs),
            "logprob_sum": logprob_sum,
            "grad_norm": grad_norm,
        }
    )


def _quickstart(steps: int, smoke_sets: list[str]) -> list[dict]:
    """Median train/step seconds of the quickstart with train.compile off and on
    (`smoke_sets`: overrides that shrink it, for --smoke)."""
    import tempfile

    from posttrain.recipes.loading import load_recipe
    from posttrain.recipes.loop import run

    root = Path(__file__).resolve().parents[1]
    rows = []
    for compiled in (False, True):
        recipe = load_recipe(
            root / "recipes" / "quickstart_grpo.yaml",
            [
                *smoke_sets,
                f"train.steps={steps}",
                "eval=null",
                f"train.compile={compiled}",
                *QUIET,
            ],
        )
        with tempfile.TemporaryDirectory() as tmp:
            history = run(recipe, Path(tmp) / "run")
        rest = history[1:] or history
        rows.append(
            {
                "variant": "compiled layers" if compiled else "eager",
                "first_train": history[0]["time/train"],
                "train": statistics.median(h["time/train"] for h in rest),
                "step": statistics.median(h["time/step"] for h in rest),
                "rewards": [round(h["reward_mean"], 4) for h in history],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=160)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quickstart-steps", type=int, default=0)
    ap.add_argument("--skip-micro", action="store_true", help="only the quickstart runs")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    smoke_sets = []
    if args.smoke:
        args.model, args.label = str(tiny_model()), "tiny random Llama (smoke)"
        args.rows, args.prompt, args.response, args.repeats, args.threads = 2, 8, 4, 1, 1
        smoke_sets = tiny_run(Path(args.model))
        # Inductor compiles in this process instead of starting a pool of compile workers
        # (the pool's start-up is most of a tiny model's compile on 2 cores).
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    else:
        args.model, args.label = str(resolve_model_path("smollm2-135m-instruct")), "SmolLM2-135M"
    ctx = mp.get_context("spawn")
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    results = {}
    for name, compiled in () if args.skip_micro else (("eager", False), ("compiled layers", True)):
        queue = ctx.Queue()
        p = ctx.Process(target=_variant, args=(compiled, vars(args), queue))
        p.start()
        results[name] = queue.get(timeout=3600)
        p.join()
    quick = _quickstart(args.quickstart_steps, smoke_sets) if args.quickstart_steps else []
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    print(header())
    if quick:
        print(
            f"\nquickstart, {args.quickstart_steps} steps each (eval off); medians of steps 1 on\n"
        )
        print("| variant | step 0 train s | train s | step s | train vs eager | rewards |")
        print("|---|---|---|---|---|---|")
        for q in quick:
            print(
                f"| {q['variant']} | {q['first_train']:.1f} | {q['train']:.2f} | "
                f"{q['step']:.2f} | {q['train'] / quick[0]['train']:.2f}x | {q['rewards']} |"
            )
    if not results:
        print(f"\nload average before: {' '.join(load0)}; after: {' '.join(load1)}")
        return
    print(
        f"\n{args.label}, FSDP2 1 rank x {args.threads} threads, bf16 compute, one training "
        f"forward/backward of {args.rows} rows x ({args.prompt} + {args.response}) tokens; "
        f"medians of {args.repeats} after the first call\n"
    )
    print(
        "| variant | first call s (CPU s) | steady s (CPU s) | steady vs eager | logprob sum "
        "| grad norm |"
    )
    print("|---|---|---|---|---|---|")
    base = results["eager"]
    for name, v in results.items():
        print(
            f"| {name} | {v['first']:.1f} ({v['first_cpu']:.1f}) | {v['train']:.2f} "
            f"({v['train_cpu']:.2f}) | {v['train'] / base['train']:.2f}x "
            f"| {v['logprob_sum']:.3f} | {v['grad_norm']:.4f} |"
        )
    print(f"\nload average before: {' '.join(load0)}; after: {' '.join(load1)}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
