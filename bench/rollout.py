"""Rollout throughput: vLLM (the synchronous `LLM` and `AsyncLLM`,
`rollout.vllm.async_engine`) vs the transformers engine on the same prompts and
settings, in one run.

    .venv/bin/python bench/rollout.py [--prompts 16] [--samples 8] [--max-new-tokens 64]
        [--dtype bfloat16] [--threads 2] [--compiled] [--no-hf] [--smoke]

Each engine's process starts on the allocator a rollout worker gets (`allocator_options`).
Rows: each engine with the whole batch in one `generate` call; 'vllm async, 4 callers'
splits the same prompts over 4 threads calling `generate` at once (as episode turns and
agent calls reach the engine), which AsyncLLM batches together. `--async-threads N` adds
an AsyncLLM row whose worker gets N threads instead of `--threads` (AsyncLLM's core is a
child process beside the calling one and gets `vllm_async.core_threads(N, params)`: N from
50M parameters on, else N − 1, at least 1).

SmolLM2-135M-Instruct, quickstart-style prompts (one-digit addition, the quickstart's
system prompt). Each engine lives in its own process with `--threads` torch threads
(all started first, each warmed up by one generate); then --repeats rounds, each timing
every row once in turn, so a change of load on the machine reaches every row; the
median per row.
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
from posttrain.recipes.roles.start import allocator_options  # noqa: E402


class Bench:
    def __init__(self, settings: EngineSettings, threads: int):
        set_torch_threads(threads)
        t0 = time.perf_counter()
        self.engine = make_engine(settings)
        self.startup = time.perf_counter() - t0

    def warm(self, messages, sampling: SamplingSettings) -> float:
        """Tokenize the prompts and run one untimed generate; the startup seconds."""
        self.prompts = [self.engine.tokenize_chat(m) for m in messages]
        self.engine.generate(self.prompts, sampling)
        return self.startup

    def once(self, sampling: SamplingSettings, callers: int) -> tuple[float, int]:
        """One timed round: the prompts split over `callers` threads, each one
        `generate` call, all at once; (seconds, response tokens)."""
        from concurrent.futures import ThreadPoolExecutor

        if callers == 1:  # on this thread: vLLM's CPU attention checks the OpenMP thread
            t0 = time.perf_counter()  # count of the thread that built the engine
            outs = [self.engine.generate(self.prompts, sampling)]
            return time.perf_counter() - t0, sum(len(x.token_ids) for g in outs[0] for x in g)
        chunks = [self.prompts[i::callers] for i in range(callers)]
        with ThreadPoolExecutor(callers) as pool:
            t0 = time.perf_counter()
            outs = list(pool.map(lambda c: self.engine.generate(c, sampling), chunks))
            seconds = time.perf_counter() - t0
        return seconds, sum(len(x.token_ids) for out in outs for g in out for x in g)

    def close(self) -> None:
        self.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--async-threads", type=int, default=0, help="also AsyncLLM on a worker of N threads"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a stop string (repeatable; the quickstart's are '\\n' and '.'): vLLM then "
        "detokenizes, in the async engine's caller process",
    )
    ap.add_argument("--compiled", action="store_true", help="also vLLM with torch.compile")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers engine")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument(
        "--tiny", action="store_true", help="the smoke's tiny random model, at the given sizes"
    )
    args = ap.parse_args()
    if args.smoke:
        path, label = str(tiny_model(vllm=True)), "tiny random Llama (smoke)"
        args.prompts, args.samples, args.max_new_tokens, args.repeats, args.threads = 2, 2, 4, 1, 1
    elif args.tiny:
        path, label = str(tiny_model(vllm=True)), "tiny random Llama (2 layers, hidden 128)"
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
        n=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        seed=0,
        stop=tuple(args.stop),
    )
    engines = [] if args.no_hf else [("hf", EngineSettings("hf", path, args.dtype))]
    engines += [
        ("vllm (eager)", EngineSettings("vllm", path, args.dtype)),
        ("vllm async (eager)", EngineSettings("vllm_async", path, args.dtype)),
    ]
    threads = {name: args.threads for name, _ in engines}
    if args.async_threads:
        name = f"vllm async (eager), worker {args.async_threads} thread(s)"
        engines.append((name, EngineSettings("vllm_async", path, args.dtype)))
        threads[name] = args.async_threads
    if args.compiled:
        engines.append(
            ("vllm (compiled)", EngineSettings("vllm", path, args.dtype, enforce_eager=False))
        )
    # rows: (name, engine index, callers); 'vllm async, 4 callers' reuses the async engine
    plan = [(name, i, 1) for i, (name, _) in enumerate(engines)]
    ai = next(i for i, (name, _) in enumerate(engines) if name == "vllm async (eager)")
    plan.insert(ai + 1, ("vllm async, 4 callers", ai, 4))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actors, startup = [], []
    for name, settings in engines:  # one at a time, so each startup is timed alone
        # each engine's process on the allocator a rollout worker gets
        remote = ray.remote(num_cpus=0)(Bench).options(**allocator_options(settings.device))
        actors.append(remote.remote(settings, threads[name]))
        startup.append(ray.get(actors[-1].warm.remote(messages, sampling)))
    times: dict[str, list[float]] = {name: [] for name, _, _ in plan}
    tokens: dict[str, list[int]] = {name: [] for name, _, _ in plan}
    # rounds interleave the rows, so a change of load on the machine hits all of them
    for r in range(args.repeats):
        s = SamplingSettings(**{**sampling.__dict__, "seed": sampling.seed + r + 1})
        for name, i, callers in plan:
            seconds, n = ray.get(actors[i].once.remote(s, callers))
            times[name].append(seconds)
            tokens[name].append(n)
            print(f"round {r}: {name} {seconds:.2f} s, {n} tokens", flush=True)
    ray.get([a.close.remote() for a in actors])
    ray.shutdown()
    rows = [
        (
            name,
            {
                "startup": startup[i],
                "seconds": statistics.median(times[name]),
                "tokens": sum(tokens[name]),
                "tps": sum(tokens[name]) / sum(times[name]),
            },
        )
        for name, i, _ in plan
    ]
    base = rows[0][1]["tps"]
    sync_tps = next(r for name, r in rows if name == "vllm (eager)")["tps"]
    print(header())
    print(
        f"\n{label} {args.dtype}, {args.prompts} prompts x {args.samples} samples, "
        f"<= {args.max_new_tokens} new tokens, stop strings {list(args.stop)}, "
        f"{args.threads} threads, median of "
        f"{args.repeats} interleaved rounds; tokens/s: all rounds' tokens / their seconds\n"
    )
    print(
        f"| engine | startup s | generate s (median) | tokens (all rounds) | tokens/s | "
        f"vs {rows[0][0]} | vs vllm |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        tps = r["tps"]
        print(
            f"| {name} | {r['startup']:.1f} | {r['seconds']:.2f} | {r['tokens']} | "
            f"{tps:.0f} | {tps / base:.2f}x | {tps / sync_tps:.2f}x |"
        )


if __name__ == "__main__":
    main()
