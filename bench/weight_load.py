"""Where a weight push's time goes inside one vLLM engine, with no transport at all:
the tensors are already in the engine's process, in its dtype.

    .venv/bin/python bench/weight_load.py [--repeats 3] [--top 14] [--smoke]

SmolLM2-135M-Instruct (the built-in model), bf16, vLLM on CPU in this process (as the
rollout actor runs it). Rows: one memcpy of the bytes (the floor of any load), the
engine's `load_weights` (what every transport ends in, with the prefix-cache reset)
through the direct load (`rollout.vllm.direct_load`, the default on CPU) and through
vLLM's layerwise `reload_weights`, alternating, and the parts of one default load from
cProfile (cumulative seconds of the functions that take most; nested rows overlap).
Median of `--repeats` after one warm-up load each way. `--smoke`: a tiny random model
(vLLM-sized), one repeat, 5 profile rows (checks the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

from _header import header  # bench/ is sys.path[0] when a bench runs
from _smoke import SMOKE_HELP, tiny_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.actors.engine import EngineSettings
    from posttrain.actors.vllm_engine import VLLMEngine
    from posttrain.common.model_registry import resolve_model_path
    from posttrain.learner.push import untied

    torch.set_num_threads(1)
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    if args.smoke:
        path, label, args.repeats, args.top = str(tiny_model(vllm=True)), "tiny random Llama", 1, 5
    else:
        path, label = str(resolve_model_path("smollm2-135m-instruct")), "SmolLM2-135M"
    weights = untied(
        dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict())
    )
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])
    dst = torch.empty_like(src)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    memcpy = statistics.median(timed(lambda: dst.copy_(src)) for _ in range(5))
    engine = VLLMEngine(EngineSettings("vllm", path, "bfloat16", kv_cache_gb=1, max_model_len=512))
    items = list(weights.items())
    direct = engine.direct

    def load(via_direct: bool) -> float:
        engine.direct = direct if via_direct else None
        return timed(lambda: engine.load_weights(items))

    load(True), load(False)  # warm-up (the direct loader is built on first use)
    # Alternating, so both see the same machine.
    pairs = [(load(True), load(False)) for _ in range(args.repeats)]
    engine.direct = direct
    prof = cProfile.Profile()
    prof.runcall(engine.load_weights, items)
    load1 = Path("/proc/loadavg").read_text().split()[:3]

    print(header())
    print(
        f"\n{label} bf16, {nbytes / 1e6:.1f} MB into one in-process vLLM engine "
        f"(CPU), 1 thread; median of {args.repeats}\n"
    )
    print("| part | seconds | GB/s | vs memcpy |")
    print("|---|---|---|---|")
    for name, s in (
        ("torch memcpy", memcpy),
        ("VLLMEngine.load_weights, direct load (default)", statistics.median(p[0] for p in pairs)),
        ("VLLMEngine.load_weights, vLLM's reload_weights", statistics.median(p[1] for p in pairs)),
    ):
        print(f"| {name} | {s:.3f} | {nbytes / s / 1e9:.2f} | {memcpy / s:.2f}x |")
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(args.top * 3)
    print("\ncProfile of one load (cumulative s, top functions):\n")
    rows = [x for x in out.getvalue().splitlines() if x.strip()[:1].isdigit()]
    for line in rows[: args.top * 3]:
        print("   ", line)
    print(f"\nload average before: {' '.join(load0)}; after: {' '.join(load1)}")


if __name__ == "__main__":
    main()
