"""`posttrain plan --gpu cpu`'s prediction against a real quickstart run, phase by phase.

    flock /tmp/posttrain-heavy.lock .venv/bin/python bench/plan.py [--steps 4] [--set k=v ...]
        [--smoke]

First the prediction (a fresh calibration by recipes/planning/calibrate.py, as `plan --gpu cpu
--recalibrate` makes, then recipes/planning/cpu.py), then the quickstart itself for `--steps`
steps on the real model.
The measured column is the mean over the steps after the first (which includes warm-up);
train is split into forward+backward and AdamW by the learner's spans. Ratio = measured /
predicted; the target for the step is 0.8-1.2. `--smoke`: 2 tiny steps of a tiny random
model (HF engine), calibrated into a temporary cache (checks the bench runs;
tests/bench/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _quiet import QUIET  # noqa: E402
from _smoke import SMOKE_HELP, scratch, tiny_model, tiny_run  # noqa: E402

from posttrain.common.model_registry import resolve_model_path  # noqa: E402
from posttrain.recipes.data import load_prompts  # noqa: E402
from posttrain.recipes.loading import load_recipe  # noqa: E402
from posttrain.recipes.loop import run  # noqa: E402
from posttrain.recipes.monitoring.advice import advise_run  # noqa: E402
from posttrain.recipes.monitoring.log import SPANS_FILE, read_jsonl  # noqa: E402
from posttrain.recipes.planning.cpu_view import cpu_prediction  # noqa: E402
from posttrain.recipes.planning.planner import ModelShape  # noqa: E402
from posttrain.recipes.preflight import checked_prompt_tokens  # noqa: E402


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def learner_split(spans: list[dict], steps: set[int]) -> tuple[float, float]:
    """Mean per step of rank 0's forward+backward and optimizer seconds."""
    fb, opt = [], []
    for k in steps:
        mine = [s for s in spans if s["step"] == k and s["role"] == "learner" and s["worker"] == 0]
        fb.append(sum(s["end"] - s["start"] for s in mine if s["kind"] in ("forward", "backward")))
        opt.append(sum(s["end"] - s["start"] for s in mine if s["kind"] == "optimizer"))
    return statistics.fmean(fb), statistics.fmean(opt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart_grpo.yaml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    smoke_sets = []
    if args.smoke:
        smoke_sets, args.steps = tiny_run(tiny_model()), 2
        # the tiny model's calibration must not land in the user's cache
        os.environ["POSTTRAIN_CACHE"] = str(scratch())
    recipe = load_recipe(
        Path(args.recipe),
        [
            *smoke_sets,
            f"train.steps={args.steps}",
            *QUIET,
            "eval=null",
            *args.sets,
        ],
    )
    folder = resolve_model_path(recipe.model.path)
    shape = ModelShape.from_config(Path(folder) / "config.json")
    prompts = load_prompts(recipe.data)
    tokens = checked_prompt_tokens(recipe, prompts) or 0
    load_before = loadavg()
    t0 = time.perf_counter()
    cal, pred, _ = cpu_prediction(recipe, Path(folder), shape, tokens, recalibrate=True)
    plan_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        history = run(recipe, Path(tmp) / "run", data=prompts)
        spans = read_jsonl(Path(tmp) / "run" / SPANS_FILE)
        advice = advise_run(Path(tmp) / "run", history, mtbf_hours=24.0)
    load_after = loadavg()
    steps = [h for h in history if "time/step" in h][1:]  # step 0 includes warm-up
    if not steps:
        sys.exit("need --steps 2 or more (the first step is left out)")

    def mean(key: str) -> float:
        return statistics.fmean(h[key] for h in steps)

    fb, opt = learner_split(spans, {int(h["step"]) for h in steps})
    print(header())
    rows = [
        ("generate", pred.generate, mean("time/generate")),
        ("train", pred.train, mean("time/train")),
        ("  forward+backward (rank 0)", pred.train_compute + pred.fsdp_comm, fb),
        ("  AdamW (rank 0)", pred.optimizer, opt),
        ("weight push", pred.push, mean("time/weight_sync")),
        ("step", pred.step, mean("time/step")),
        ("rollout idle fraction", pred.rollout_idle, mean("rollout_idle_fraction")),
        ("learner idle fraction", pred.learner_idle, mean("learner_idle_fraction")),
    ]
    print(
        f"calibration {cal.seconds:.1f} s (prediction in all {plan_s:.1f} s); decode probe "
        f"({cal.decode.engine}) {cal.decode.step_s * 1e3:.0f} ms/token at batch "
        f"{cal.decode.batch}; engine load {cal.push.load_s:.2f} s; gloo all-gather "
        f"{cal.push.collective_s * 1e3:.2f} ms; train-probe "
        f"MFU {pred.mfu:.0%} of {cal.matmul_flops[pred.learner_threads] / 1e9:.0f} GFLOP/s; "
        f"copy {cal.copy_bytes_per_s / 1e9:.1f} GB/s; loopback "
        f"{cal.loopback_bytes_per_s / 1e9:.2f} GB/s"
    )
    print(f"{'phase':<28} {'predicted':>10} {'measured':>10} {'ratio':>7}")
    for name, p, m in rows:
        print(f"{name:<28} {p:10.2f} {m:10.2f} {m / p if p else float('nan'):7.2f}")
    other = (
        mean("time/step") - mean("time/generate") - mean("time/train") - mean("time/weight_sync")
    )
    print(
        f"(measured: mean of steps 1..{args.steps - 1}; {other:.2f} s of the step in no "
        f"phase; response length {mean('response_length_mean'):.1f} of "
        f"{recipe.rollout.max_new_tokens} max; load {load_before} before, {load_after} after)"
    )
    print("posttrain status --advise --mtbf 24 on this run:")
    for line in advice.lines:
        print("  " + line)


if __name__ == "__main__":
    main()
