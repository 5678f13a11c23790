"""Fixed-size against token-budget micro-batches on the GSM8K recipe, side by side.

    .venv/bin/python bench/token_budget.py [--steps 3] [--budget 1024] [--smoke]
    # or in parts (one variant per invocation, e.g. each under its own lock hold):
    .venv/bin/python bench/token_budget.py --only fixed --save /tmp/tb.json
    .venv/bin/python bench/token_budget.py --only budget --save /tmp/tb.json  # prints both

Both variants run the same recipe, seed and samples (`train.micro_batch_size` rows per
micro-batch, against `train.max_tokens_per_micro_batch` real tokens with right padding
cut). The table gives means over steps after the first (which includes warm-up): the
learner's share of the step (`time/train`), the step time, their ratio to the fixed
variant, and `padding_fraction` (padded tokens / all tokens the learner computed).
The losses should agree up to rounding (same samples, same gradients). `--smoke`: 2 tiny
steps of a tiny random model (HF engine) on 8 short word problems written in process,
budget 64 tokens (checks the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _header import header  # bench/ is sys.path[0] when a bench runs
from _quiet import QUIET
from _smoke import SMOKE_HELP, tiny_model, tiny_run

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def _run(budget: int | None, args: argparse.Namespace) -> list[dict]:
    recipe = load_recipe(
        ROOT / "recipes" / "grpo_gsm8k.yaml",
        [
            *args.smoke_sets,
            f"data.train.path={args.data}",
            f"train.steps={args.steps}",
            f"train.prompts_per_step={args.prompts}",
            "train.warmup_steps=0",
            f"train.max_tokens_per_micro_batch={'null' if budget is None else budget}",
            *QUIET,
        ],
    )
    with tempfile.TemporaryDirectory() as tmp:
        return run(recipe, Path(tmp) / "run")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="train.prompts_per_step")
    ap.add_argument("--budget", type=int, default=1024, help="max_tokens_per_micro_batch")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--only", choices=["fixed", "budget"], help="run one variant")
    ap.add_argument("--save", type=Path, help="JSON of runs so far (with --only: merged)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    args.smoke_sets = []
    if args.smoke:
        model = tiny_model()
        args.smoke_sets, args.data = tiny_run(model), str(_word_problems(model.parent))
        args.steps, args.prompts, args.budget = 2, 2, 64
    names = {"fixed": "fixed (micro_batch_size 4)", "budget": f"budget {args.budget} tokens"}
    runs = json.loads(args.save.read_text()) if args.save and args.save.exists() else {}
    for key in [args.only] if args.only else list(names):
        runs[names[key]] = _run(args.budget if key == "budget" else None, args)
        runs[names[key] + " load"] = Path("/proc/loadavg").read_text().split()[:3]
    if args.save:
        args.save.write_text(json.dumps(runs))
    loads = {k.removesuffix(" load"): runs.pop(k) for k in list(runs) if k.endswith(" load")}
    if names["fixed"] not in runs:
        return
    keys = ("time/train", "time/step", "padding_fraction", "loss")
    means = {
        m: {k: statistics.fmean(h[k] for h in r[1:] or r) for k in keys} for m, r in runs.items()
    }
    base = next(iter(means.values()))
    print(header())
    which = f"means of steps 2..{args.steps}" if args.steps > 1 else "step 1, with warm-up"
    print(f"\ngrpo_gsm8k, {args.steps} steps x {args.prompts} prompts; {which}\n")
    print(
        "| micro-batches | train s | step s | train vs fixed | step vs fixed "
        "| padding_fraction | loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for m, v in means.items():
        print(
            f"| {m} | {v['time/train']:.2f} | {v['time/step']:.2f} "
            f"| {v['time/train'] / base['time/train']:.2f}x "
            f"| {v['time/step'] / base['time/step']:.2f}x | {v['padding_fraction']:.3f} "
            f"| {v['loss']:.5f} |"
        )
    print(
        "\nload average (1/5/15 min) after each variant: "
        + "; ".join(f"{m}: {' '.join(v)}" for m, v in loads.items())
    )


def _word_problems(folder: Path) -> Path:
    """8 short GSM8K-style rows (question, answer ending in `#### N`) in `folder`."""
    path = folder / "word_problems.jsonl"
    rows = [
        {"question": f"Ann has {a} pens and buys {b}. How many?", "answer": f"#### {a + b}"}
        for a, b in zip(range(1, 9), range(9, 1, -1), strict=True)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":
    main()
