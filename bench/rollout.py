"""Rollout throughput: vLLM (the synchronous `LLM` and `AsyncLLM`,
`rollout.vllm.async_engine`) vs the transformers engine on the same prompts and
settings, in one run.

    .venv/bin/python bench/rollout.py [--prompts 16] [--samples 8] [--max-new-tokens 64]
        [--dtype bfloat16] [--threads 2] [--compiled] [--no-hf] [--smoke]

Rows: each engine with the whole batch in one `generate` call; 'vllm async, 4 callers'
splits the same prompts over 4 threads calling `generate` at once (as episode turns and
agent calls reach the engine), which AsyncLLM batches together.

SmolLM2-135M-Instruct, quickstart-style prompts (one-digit addition, the quickstart's
system prompt). Each engine runs alone in its own process with `--threads` torch
threads; one warm-up generate, then the median of --repeats timed generates.
tokens/s counts sampled response tokens. `--smoke`: a tiny random model (vLLM-sized),
2 prompts x 2 samples of at most 4 tokens, one repeat, 1 thread (checks the bench runs;
tests/bench/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP, tiny_model  # noqa: E402

from posttrain.actors.engine import EngineSettings  # noqa: E402
from posttrain.actors.factory import make_engine  # noqa: E402
from posttrain.actors.rollout import SamplingSettings  # noqa: E402
from posttrain.common.model_registry import resolve_model_path  # noqa: E402
from posttrain.common.process import set_torch_threads  # noqa: E402


class Bench:
    def __init__(self, settings: EngineSettings, threads: int):
        set_torch_threads(threads)
        t0 = time.perf_counter()
        self.engine = make_engine(settings)
        self.startup = time.perf_counter() - t0

    def run(self, messages, sampling: SamplingSettings, repeats: int, callers: int = 1) -> dict:
        """Median seconds of `repeats` timed rounds after one warm-up; each round the
        prompts split over `callers` threads, each one `generate` call, all at once."""
        from concurrent.futures import ThreadPoolExecutor

        prompts = [self.engine.tokenize_chat(m) for m in messages]
        chunks = [prompts[i::callers] for i in range(callers)]
        self.engine.generate(prompts, sampling)  # warm-up
        times, tokens = [], 0
        with ThreadPoolExecutor(callers) as pool:
            for r in range(repeats):
                s = SamplingSettings(**{**sampling.__dict__, "seed": sampling.seed + r + 1})
                t0 = time.perf_counter()
                outs = list(pool.map(lambda c, s=s: self.engine.generate(c, s), chunks))
                times.append(time.perf_counter() - t0)
                tokens = sum(len(x.token_ids) for out in outs for g in out for x in g)
        self.engine.close()
        return {"startup": self.startup, "seconds": statistics.median(times), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="also vLLM with torch.compile")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers engine")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        path, label = str(tiny_model(vllm=True)), "tiny random Llama (smoke)"
        args.prompts, args.samples, args.max_new_tokens, args.repeats, args.threads = 2, 2, 4, 1, 1
    else:
        path, label = str(resolve_model_path("smollm2-135m-instruct")), "SmolLM2-135M"
    messages = [
        [
            {"role": "system", "content": "Reply with only the final number."},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ]
        for a, b in zip(range(args.prompts), reversed(range(args.prompts)), strict=True)
    ]
    sampling = SamplingSettings(
        n=args.samples, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0
    )
    engines = [] if args.no_hf else [("hf", EngineSettings("hf", path, args.dtype), 1)]
    engines += [
        ("vllm (eager)", EngineSettings("vllm", path, args.dtype), 1),
        ("vllm async (eager)", EngineSettings("vllm_async", path, args.dtype), 1),
        ("vllm async, 4 callers", EngineSettings("vllm_async", path, args.dtype), 4),
    ]
    if args.compiled:
        engines.append(
            ("vllm (compiled)", EngineSettings("vllm", path, args.dtype, enforce_eager=False), 1)
        )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    for name, settings, callers in engines:
        actor = ray.remote(num_cpus=0)(Bench).remote(settings, args.threads)
        rows.append((name, ray.get(actor.run.remote(messages, sampling, args.repeats, callers))))
        ray.kill(actor)
    ray.shutdown()
    base = rows[0][1]["tokens"] / rows[0][1]["seconds"]
    sync = next(r for name, r in rows if name == "vllm (eager)")
    sync_tps = sync["tokens"] / sync["seconds"]
    print(header())
    print(
        f"\n{label} {args.dtype}, {args.prompts} prompts x {args.samples} samples, "
        f"<= {args.max_new_tokens} new tokens, {args.threads} threads, median of "
        f"{args.repeats}\n"
    )
    print(f"| engine | startup s | generate s | tokens | tokens/s | vs {rows[0][0]} | vs vllm |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        tps = r["tokens"] / r["seconds"]
        print(
            f"| {name} | {r['startup']:.1f} | {r['seconds']:.2f} | {r['tokens']} | "
            f"{tps:.0f} | {tps / base:.2f}x | {tps / sync_tps:.2f}x |"
        )


if __name__ == "__main__":
    main()
