"""The quickstart with and without GRPO's separate old-logprob pass, side by side in
one run.

    .venv/bin/python bench/old_logprobs.py [--steps 6] [--smoke]

With one optimizer step per batch, `old_logprobs` equal the update's own logprobs, so
`grpo.old_logprob_pass: auto` (the default) takes them from the training forward;
`always` runs the extra no-grad forward over every rollout first, as posttrain did
before. The two variants alternate (always, auto, always, auto) so that drift in the
machine's load falls on both. The table gives means over steps after the first (which
includes warm-up): step time, the logprob pass, training, the ratio of step times, and
the per-step rewards of both (equal up to rounding: same seed, same samples). `--smoke`:
2 tiny steps of a tiny random model (HF engine) per mode (checks the bench runs;
tests/bench/).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _header import header  # bench/ is sys.path[0] when a bench runs
from _quiet import QUIET
from _smoke import SMOKE_HELP, tiny_model, tiny_run

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run

ROOT = Path(__file__).resolve().parents[1]


def _run(mode: str, steps: int, smoke_sets: list[str]) -> list[dict]:
    recipe = load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml",
        [*smoke_sets, f"train.steps={steps}", f"grpo.old_logprob_pass={mode}", *QUIET],
    )
    with tempfile.TemporaryDirectory() as tmp:
        return run(recipe, Path(tmp) / "run")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="always/auto pairs to run")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    smoke_sets = tiny_run(tiny_model()) if args.smoke else []
    if args.smoke:
        args.steps, args.rounds = 2, 1
    runs: dict[str, list[list[dict]]] = {"always": [], "auto": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(_run(mode, args.steps, smoke_sets))
    keys = ("time/step", "time/logprobs", "time/train", "logprob_mismatch")
    means = {
        m: {k: statistics.fmean(h[k] for r in rs for h in r[1:]) for k in keys}
        for m, rs in runs.items()
    }
    base = means["always"]["time/step"]
    print(header())
    print(
        f"\nquickstart, {args.steps} steps x {args.rounds} round(s) per mode; means of steps "
        f"2..{args.steps}\n"
    )
    print("| old_logprob_pass | step s | logprobs s | train s | step vs always | mismatch |")
    print("|---|---|---|---|---|---|")
    for m, v in means.items():
        print(
            f"| {m} | {v['time/step']:.2f} | {v['time/logprobs']:.2f} | {v['time/train']:.2f} "
            f"| {v['time/step'] / base:.2f}x | {v['logprob_mismatch']:.4f} |"
        )
    for m, rs in runs.items():
        print(f"rewards per step ({m}): {[round(h['reward_mean'], 4) for h in rs[0]]}")


if __name__ == "__main__":
    main()
