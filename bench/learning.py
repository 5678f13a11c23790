"""Does each shipped recipe learn? Before and after training on its own held-out set.

    .venv/bin/python bench/learning.py [RECIPE ...] [--set KEY=VALUE ...] [--smoke]

RECIPE: names of recipes/*.yaml (default: all of them). For each: the base model (the
recipe's `model.path`) is evaluated on the recipe's held-out set, the recipe is trained
(`posttrain run`'s loop, in this process), and the trained run folder is evaluated on
the same set, both with `posttrain eval`'s code (recipes/assess/command.py): pass@1 for
GRPO / PPO (`eval:` prompts), implicit-reward accuracy for DPO and pairwise accuracy
for a reward model (`data.heldout` pairs). One table: recipe, metric, before, after,
the change and its 95% interval (paired percentile bootstrap over prompts or pairs,
2,000 resamples), the after value's own interval, training time.

A DPO policy before training is its own reference, so its "before" is 0.5 (every pair a
tie); a reward model before training is the base with a new score head (seeded with
`train.seed`). `--smoke`: the two pair recipes (or the ones named) on a tiny random
model, 2 steps, a few pairs (checks the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP, tiny_model  # noqa: E402

SMOKE_RECIPES = ["rm_hh", "dpo_hh"]


def smoke_sets(model: Path, algorithm: str) -> list[str]:
    """Overrides that shrink a shipped pair recipe to 2 tiny steps on `model`."""
    common = [
        f"model.path={model}",
        "model.dtype=float32",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.micro_batch_size=2",
        "train.warmup_steps=0",
        "train.lr=1e-3",
        "data.train.limit=8",
        "data.heldout.limit=6",
        "resources.learner.gpus=1",
        "resources.threads_per_worker=1",
        "monitor.progress=false",
        "monitor.tensorboard=false",
    ]
    block = "reward_model" if algorithm == "reward_model" else "dpo"
    return [*common, f"{block}.max_length=64"]


def paired_change(before: list[float], after: list[float]) -> tuple[float, float]:
    """95% interval of mean(after − before) over the same items (paired bootstrap)."""
    from posttrain.recipes.assess.scoring import bootstrap_ci

    return bootstrap_ci([a - b for a, b in zip(after, before, strict=True)])


def one_recipe(name: str, sets: list[str], work: Path) -> dict:
    """Evaluate the base, train, evaluate the run; the table row of recipe `name`."""
    from posttrain.common.model_registry import resolve_model_path
    from posttrain.recipes.assess.command import evaluate_target
    from posttrain.recipes.assess.scoring import bootstrap_ci
    from posttrain.recipes.data import load_data
    from posttrain.recipes.loading import load_recipe
    from posttrain.recipes.loop import run

    path = ROOT / "recipes" / f"{name}.yaml"
    recipe = load_recipe(path, sets)
    base = str(resolve_model_path(recipe.model.path))
    before = evaluate_target(base, path, sets, out=work / f"{name}-before")
    t0 = time.time()
    run(recipe, work / name, None, load_data(recipe).train)
    train_s = time.time() - t0
    after = evaluate_target(str(work / name), None, sets, out=work / f"{name}-after")
    b, a = before["items"], after["items"]
    return {
        "recipe": name,
        "metric": f"{after['metric']} ({after['evaluation']}, {len(a)} held out)",
        "before": statistics.fmean(b),
        "after": statistics.fmean(a),
        "change_ci": paired_change(b, a),
        "after_ci": bootstrap_ci(a),
        "train_s": train_s,
        "before_metrics": before["metrics"],
        "after_metrics": after["metrics"],
    }


def print_table(rows: list[dict]) -> None:
    print(
        "| recipe | metric | before | after | change (95% CI) | after 95% CI | training s |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in rows:
        lo, hi = r["change_ci"]
        alo, ahi = r["after_ci"]
        print(
            f"| {r['recipe']} | {r['metric']} | {r['before']:.3f} | {r['after']:.3f} | "
            f"{r['after'] - r['before']:+.3f} ({lo:+.3f} to {hi:+.3f}) | "
            f"{alo:.3f}–{ahi:.3f} | {r['train_s']:.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipes", nargs="*", help="names of recipes/*.yaml (default: all)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="override, all")
    ap.add_argument("--json", type=Path, help="also write the rows (with every metric) here")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument(
        "--work", type=Path, help="keep the run folders and evaluations here (default: a temp dir)"
    )
    args = ap.parse_args()
    names = args.recipes or (
        SMOKE_RECIPES if args.smoke else sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    )
    model = tiny_model() if args.smoke else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.smoke:  # the real model's converted folder stays in the usual cache
            os.environ.setdefault("POSTTRAIN_CACHE", str(Path(tmp) / "cache"))
        for name in names:
            sets = list(args.sets)
            if model is not None:
                from posttrain.recipes.loading import load_recipe

                algorithm = load_recipe(ROOT / "recipes" / f"{name}.yaml").algorithm
                sets = smoke_sets(model, algorithm) + sets
            rows.append(one_recipe(name, sets, work))
            print(f"done: {name} {json.dumps(rows[-1])}", flush=True)
    print(header())
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
