"""DPO with and without reference-logprob precompute, side by side in one run.

    .venv/bin/python bench/dpo.py [--steps 4] [--pairs 64] [--smoke]

Runs recipes/dpo_hh.yaml on the real model twice on the same data (its shipped HH-RLHF
pairs): once with the reference's logprobs precomputed and cached (then the reference
leaves memory), once with the reference in the loop; then TRL's DPOTrainer (reference in
the loop, its default) on the same model, pairs, batch, β, LR and max length, in one
process with all cores as torch threads, in its own virtualenv (`.bench-venv/trl`, made on
first use as bench/sft.py makes it; TRL is not a dependency of posttrain). Prints mean
seconds per step over steps after the first (same pairs per step, so the ratio is the
pairs/s ratio), tokens/s of posttrain's padded batches, and the precompute's time and
cache size. `--smoke`: 2 tiny steps of a tiny random model on 8 short pairs written in
process, one learner rank (and TRL, when `.bench-venv/trl` exists, on the same) (checks
the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP, tiny_model  # noqa: E402
from _trl import run_trl_worker, trl_python  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        _trl_worker(args)
        return
    from posttrain.common.model_registry import resolve_model_path

    smoke_sets = []
    if args.smoke:
        model_dir = tiny_model()
        args.steps, args.pairs = 2, 8
        smoke_sets = [
            f"data.train.path={_short_pairs(model_dir.parent, args.pairs)}",
            "data.train.format=pairs",
            "model.dtype=float32",
            "train.prompts_per_step=2",
            "train.micro_batch_size=2",
            "train.warmup_steps=0",
            "dpo.max_length=64",
            "resources.learner.gpus=1",
        ]
    else:
        model_dir = resolve_model_path("smollm2-135m-instruct")  # before the cache moves
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["POSTTRAIN_CACHE"] = tmp  # a cold cache: the precompute really runs
        from posttrain.recipes.data.pairs import load_pairs
        from posttrain.recipes.loading import load_recipe
        from posttrain.recipes.loop import run

        results = {}
        for precompute in (True, False):
            recipe = load_recipe(
                ROOT / "recipes" / "dpo_hh.yaml",
                [
                    *smoke_sets,
                    f"train.steps={args.steps}",
                    f"data.train.limit={args.pairs}",
                    f"model.path={model_dir}",
                    f"dpo.precompute_ref_logprobs={str(precompute).lower()}",
                    "monitor.progress=false",
                    "monitor.tensorboard=false",
                    "train.save_final=false",
                ],
            )
            d = recipe.data.train
            pairs, _ = load_pairs(d.path, d.format, limit=d.limit)
            run_dir = Path(tmp) / f"pre-{precompute}"
            history = run(recipe, run_dir, None, pairs)
            info = json.loads((run_dir / "precompute.json").read_text()) if precompute else {}
            steps = history[1:] or history
            results[precompute] = (
                statistics.fmean(h["time/step"] for h in steps),
                statistics.fmean(h["tokens"] for h in steps)
                / statistics.fmean(h["time/step"] for h in steps),
                info,
            )
    trl_row = _trl(model_dir, pairs, args, recipe)
    with_s, with_tps, info = results[True]
    without_s, without_tps, _ = results[False]
    print(header())
    print(f"{'mode':34} {'step s':>8} {'tokens/s':>9} {'vs in-loop':>10}")
    print(
        f"{'reference precomputed (cached)':34} {with_s:8.2f} {with_tps:9.0f} "
        f"{with_s / without_s:9.2f}x"
    )
    print(f"{'reference in the loop':34} {without_s:8.2f} {without_tps:9.0f} {1.0:9.2f}x")
    if trl_row is not None:
        print(
            f"{'TRL DPOTrainer (ref in the loop)':34} {trl_row:8.2f} {'':>9} "
            f"{trl_row / without_s:9.2f}x"
        )
        print(
            f"posttrain (precomputed) pairs/s vs TRL: {trl_row / with_s:.2f}x; "
            f"(in the loop) vs TRL: {trl_row / without_s:.2f}x"
        )
    else:
        print("TRL DPOTrainer: not run (--smoke and no .bench-venv/trl), not compared")
    print(
        f"precompute: {info.get('pairs')} pairs in {info.get('seconds', 0):.1f} s "
        f"(cache hit: {info.get('cache_hit')}), cache file {info.get('bytes', 0)} bytes"
    )
    print(
        f"(mean of steps 2..{args.steps}; {args.pairs} pairs of {recipe.data.train.path}; "
        f"{recipe.resources.learner.gpus} learner rank(s) on {os.cpu_count()} cores)"
    )


def _short_pairs(folder: Path, n: int) -> Path:
    """`n` short chat preference pairs (format: pairs) in `folder`, for --smoke."""
    rows = [
        {"prompt": f"What is {i} + {i}?", "chosen": str(2 * i), "rejected": f"{i} and {i}"}
        for i in range(n)
    ]
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trl_worker(a: argparse.Namespace) -> None:
    """TRL's DPOTrainer on the pairs in `a.data` (runs inside `_trl.VENV`: imports
    nothing of posttrain); saves the seconds between its step ends to `a.save`."""
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = json.loads(Path(a.data).read_text())
    tok = AutoTokenizer.from_pretrained(a.trl_worker)
    model = AutoModelForCausalLM.from_pretrained(a.trl_worker, dtype=torch.float32)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=cfg["batch"],
            max_steps=a.steps,
            learning_rate=cfg["lr"],
            beta=cfg["beta"],
            max_length=cfg["max_length"],
            bf16=cfg["bf16"],
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            dataloader_num_workers=0,
        )
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(cfg["pairs"]),
            processing_class=tok,
            callbacks=[Clock()],
        )
        stamps.append(time.perf_counter())
        trainer.train()
    Path(a.save).write_text(
        json.dumps({"gaps": [y - x for x, y in zip(stamps, stamps[1:], strict=False)]})
    )


def _trl(model_dir: Path, pairs: list, args: argparse.Namespace, recipe) -> float | None:
    """Mean seconds per step of TRL's DPOTrainer (steps after the first) on the same
    pairs, batch, LR, beta and max length, in TRL's own virtualenv (`_trl.VENV`, made on
    first use) with every core as torch threads; None when --smoke finds no VENV."""
    py = trl_python(args.smoke)
    if py is None:
        return None
    cfg = {
        "pairs": [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs],
        "batch": recipe.train.prompts_per_step,
        "lr": recipe.train.lr,
        "beta": recipe.dpo.beta,
        "max_length": recipe.dpo.max_length,
        "bf16": recipe.model.dtype == "bfloat16",
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(json.dumps(cfg))
        f.flush()
        argv = [str(model_dir), "--data", f.name, "--steps", str(args.steps)]
        gaps = run_trl_worker(py, __file__, argv)["gaps"][1:]
    return statistics.fmean(gaps) if gaps else None


if __name__ == "__main__":
    main()
