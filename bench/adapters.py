"""Full fine-tuning vs LoRA vs QLoRA on SmolLM2-135M, same recipe and data, one run.

    .venv/bin/python bench/adapters.py [--steps 3] [--out bench_runs/adapters] [--smoke]

Runs the quickstart recipe (vLLM engine, collective weight sync) three times with
`--set` overrides: full (every weight pushed), LoRA r=16 and QLoRA r=16 (NF4 base), both
with `weight_sync.adapter_mode: adapter` (only adapter tensors pushed; QLoRA sends its
dequantised base once before step 0). Step 0 is left out of the means (warm-up).

Columns: trainable parameters and frozen-base bytes (the learner's memory report), peak
resident memory of learner rank 0, mean step seconds, bytes per weight push, push
seconds, rollout tokens/s. Each run is `python -m posttrain.recipes.cli run` with this
interpreter (so a checkout without .venv/ runs its own code). `--smoke`: 2 tiny steps of a
tiny random model (HF engine, one learner rank) per mode, into a temporary folder (checks
the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from _header import header  # bench/ is sys.path[0] when a bench runs
from _smoke import SMOKE_HELP, scratch, tiny_model, tiny_run

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "full": [],
    "LoRA r16": [
        "model.adapter={type: lora, r: 16, alpha: 32}",
        "train.lr=2.0e-5",
        "weight_sync.adapter_mode=adapter",
    ],
    "QLoRA r16": [
        "model.adapter={type: qlora, r: 16, alpha: 32}",
        "train.lr=2.0e-5",
        "weight_sync.adapter_mode=adapter",
    ],
}


def run(name: str, sets: list[str], steps: int, out: Path) -> dict:
    run_dir = out / name.split()[0].lower()
    cmd = [
        sys.executable,
        "-m",
        "posttrain.recipes.cli",
        "run",
        str(ROOT / "recipes/quickstart_grpo.yaml"),
        "--out",
        str(run_dir),
        "--set",
        f"train.steps={steps}",
        "--set",
        "monitor.dashboard_port=null",
        "--set",
        "monitor.progress=false",
        "--set",
        "train.save_final=false",
    ]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{name}: posttrain run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    report = re.search(
        r"learner memory: trainable ([\d,]+) params.*?frozen [\d,]+ params "
        r"([\d.]+) MiB",
        proc.stdout + proc.stderr,
    )
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    mean = lambda k: statistics.mean(x[k] for x in m)  # noqa: E731
    return {
        "trainable": int(report.group(1).replace(",", "")) if report else -1,
        "frozen_mib": float(report.group(2)) if report else float("nan"),
        "peak_mb": max(x["learner_peak_rss_mb"] for x in m),
        "step_s": mean("time/step"),
        "sync_bytes": mean("weight_sync_bytes"),
        "sync_s": mean("time/weight_sync"),
        "tokens_s": mean("rollout_tokens_per_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench_runs" / "adapters")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    smoke_sets = []
    what = "SmolLM2-135M, quickstart recipe, vLLM + collective sync, 2 learner ranks"
    if args.smoke:
        smoke_sets = tiny_run(tiny_model())
        args.steps, args.out = 2, scratch()
        what = "tiny random Llama (smoke), quickstart recipe, HF engine, 1 learner rank"
    rows = [
        (name, run(name, [*smoke_sets, *sets], args.steps, args.out))
        for name, sets in MODES.items()
    ]
    full = rows[0][1]
    print(header())
    print(f"\n{what}, {args.steps} steps (means over steps 1..)\n")
    print(
        "| mode | trainable params | frozen base MiB | learner peak RSS MiB | step s | "
        "push bytes | push s | rollout tokens/s | step vs full |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['trainable']:,} | {r['frozen_mib']:.1f} | {r['peak_mb']:.0f} | "
            f"{r['step_s']:.1f} | {r['sync_bytes'] / 1e6:.1f} MB | {r['sync_s']:.2f} | "
            f"{r['tokens_s']:.0f} | {r['step_s'] / full['step_s']:.2f}x |"
        )


if __name__ == "__main__":
    main()
