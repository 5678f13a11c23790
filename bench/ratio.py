"""Rollout:learner worker splits of the quickstart, side by side in one run.

    .venv/bin/python bench/ratio.py [--steps 3] [--splits 1:1,2:1,1:2] [--smoke]

Each split runs the quickstart recipe for a few steps on the real model (declared
devices on a CPU machine, so a "GPU" here is a worker process sharing 2 cores). The
table gives the mean over steps after the first (which includes warm-up): step time,
generate and train seconds, both idle fractions and the generation tail. `--smoke`: 2
tiny steps of a tiny random model (HF engine) per split, splits 1:1 and 1:2 (checks the
bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _quiet import QUIET  # noqa: E402
from _smoke import SMOKE_HELP, tiny_model, tiny_run  # noqa: E402

from posttrain.recipes.loading import load_recipe  # noqa: E402
from posttrain.recipes.loop import run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--splits", default="1:1,2:1,1:2")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    smoke_sets = tiny_run(tiny_model()) if args.smoke else []
    if args.smoke:
        args.steps, args.splits = 2, "1:1,1:2"
    rows = []
    for split in args.splits.split(","):
        n_r, n_l = (int(x) for x in split.split(":"))
        recipe = load_recipe(
            ROOT / "recipes" / "quickstart_grpo.yaml",
            [
                *smoke_sets,
                f"train.steps={args.steps}",
                f"resources.rollout.gpus={n_r}",
                f"resources.learner.gpus={n_l}",
                *QUIET,
            ],
        )
        with tempfile.TemporaryDirectory() as tmp:
            history = run(recipe, Path(tmp) / "run")[1:]  # step 0 includes warm-up
        keys = (
            "time/step",
            "time/generate",
            "time/train",
            "rollout_idle_fraction",
            "learner_idle_fraction",
            "time/generation_tail",
        )
        rows.append((split, *(statistics.fmean(h[k] for h in history) for k in keys)))
    base = rows[0][1]
    print(header())
    print(
        f"{'rollout:learner':>15} {'step s':>7} {'vs first':>8} {'gen s':>6} {'train s':>7} "
        f"{'rollout idle':>12} {'learner idle':>12} {'tail s':>6}"
    )
    for split, step, gen, train, ri, li, tail in rows:
        print(
            f"{split:>15} {step:7.1f} {step / base:7.2f}x {gen:6.1f} {train:7.1f} "
            f"{ri:12.2f} {li:12.2f} {tail:6.2f}"
        )
    print(f"(mean of steps 2..{args.steps} per split; 2 CPU cores shared by every worker)")


if __name__ == "__main__":
    main()
