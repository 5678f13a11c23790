"""GRPO throughput: TRL's GRPOTrainer against posttrain on one workload, side by side.

    .venv/bin/python bench/vs_trl.py [--steps 6] [--data GSM8K_TRAIN_JSONL]
    # or in parts (each part fits one hold of a shared machine's lock):
    .venv/bin/python bench/vs_trl.py --only trl --save /tmp/vs_trl.json
    .venv/bin/python bench/vs_trl.py --only posttrain --save /tmp/vs_trl.json  # prints both
    .venv/bin/python bench/vs_trl.py --smoke   # seconds: tiny model, both sides' code runs

The workload of issue 15 (`--shape gsm8k`, the default): SmolLM2-135M-Instruct (the
built-in model's converted folder), GSM8K train prompts with the recipe's system prompt,
8 prompts × 4 samples per step, at most 64 new tokens, temperature 1, KL 0, lr 1e-6
(constant), float32 master weights with bf16 compute on both sides, micro-batches of 16
sequences; the first step (warm-up) is left out of the medians. `--shape quickstart`:
the quickstart recipe's own prompts (one-digit addition), system prompt and lr (5e-6,
constant), 4 prompts × 8 samples, at most 24 new tokens.

- TRL runs in its own virtualenv (`.bench-venv/trl`, made on first use: `pip install
  torch==2.13.0 trl==1.16.0 datasets`), in one process with every core as torch
  threads (`bf16=True` on CPU: fp32 weights under bf16 autocast), generating with
  `model.generate`. Its reward: 1 when the last number of the completion equals the
  reference answer (reward values do not change the work done per step).
- posttrain runs `recipes/grpo_gsm8k.yaml` (or `quickstart_grpo.yaml`) with the
  overrides printed below, through `posttrain run`'s start-up path (its checked data,
  and the learner layout the run predicts faster unless the recipe pins one, its line
  printed); its vLLM engine and weight transport as the recipe says.

Columns: s/step (median), its parts (TRL: generate = TRL's `_generate` (`model.generate`
and decoding); train = the rest of the step), and generated tokens per second end
to end (completion tokens of the step / step time), with the ratio posttrain / TRL.

`--smoke`: 2 steps of a tiny random model on the quickstart's prompts, 2 prompts x 2
samples of at most 4 tokens (posttrain on its HF engine); TRL only when `.bench-venv/trl`
already exists (a smoke run never installs it: it prints a line saying TRL was skipped).
It checks the bench runs (tests/bench/).
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

from _header import header  # bench/ is sys.path[0] when a bench runs
from _quiet import QUIET
from _smoke import SMOKE_HELP, tiny_model, tiny_run
from _trl import run_trl_worker, trl_python

ROOT = Path(__file__).resolve().parents[1]
#: GSM8K's train split beside the repo (../shared/data, where the machine has it), else
#: the 400 rows the grpo_gsm8k recipe ships (8 prompts x 50 steps).
SHARED_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
SAMPLE_GSM8K = ROOT / "recipes" / "datasets" / "gsm8k" / "train.jsonl"
DATA = SHARED_GSM8K if SHARED_GSM8K.is_file() else SAMPLE_GSM8K
#: Two workloads (`--shape`): issue 15's GSM8K one, and the quickstart's (one-digit
#: addition, 4 prompts x 8 samples, <= 24 new tokens, its system prompt and lr).
SHAPES = {
    "gsm8k": {
        "recipe": "grpo_gsm8k.yaml",
        "prompts": 8,
        "samples": 4,
        "new_tokens": 64,
        "lr": 1e-6,
        "micro": 16,
        "system": "Solve the problem step by step. End with the final answer as: #### <number>",
    },
    "quickstart": {
        "recipe": "quickstart_grpo.yaml",
        "prompts": 4,
        "samples": 8,
        "new_tokens": 24,
        "lr": 5e-6,
        "micro": 16,
        "system": "Reply with only the final number.",
    },
    # --smoke only: the quickstart's prompts, tiny.
    "smoke": {
        "recipe": "quickstart_grpo.yaml",
        "prompts": 2,
        "samples": 2,
        "new_tokens": 4,
        "lr": 5e-6,
        "micro": 4,
        "system": "Reply with only the final number.",
    },
}


def overrides(w: dict) -> list[str]:
    """posttrain's `--set`s for workload `w` (the rest is its recipe)."""
    return [
        f"train.prompts_per_step={w['prompts']}",
        f"rollout.samples_per_prompt={w['samples']}",
        f"rollout.max_new_tokens={w['new_tokens']}",
        "grpo.kl_coef=0",
        f"train.micro_batch_size={w['micro']}",
        "train.warmup_steps=0",
        f"train.lr={w['lr']}",
    ]


# -- TRL side (runs inside .bench-venv/trl: imports nothing of posttrain) ---------------------
def _trl_worker(model_path: str, data: str, steps: int, out: str, w: dict) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    prompts, samples, micro = w["prompts"], w["samples"], w["micro"]
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()[: prompts * (steps + 2)]]
    ds = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": w["system"]},
                    {"role": "user", "content": r["question"]},
                ],
                "answer": r["answer"].split("####")[-1].strip().replace(",", ""),
            }
            for r in rows
        ]
    )

    def correct(completions, answer, **_):
        import re

        out = []
        for c, a in zip(completions, answer, strict=True):
            nums = re.findall(r"-?\d[\d,]*\.?\d*", c[0]["content"] if isinstance(c, list) else c)
            out.append(float(bool(nums) and nums[-1].replace(",", "").rstrip(".") == a))
        return out

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        use_cpu=True,
        bf16=True,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=prompts * samples // micro,
        num_generations=samples,
        max_completion_length=w["new_tokens"],
        temperature=1.0,
        beta=0.0,
        learning_rate=w["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model, args=args, reward_funcs=correct, train_dataset=ds, processing_class=tok
    )
    rec: list[dict] = []
    cur: dict = {}
    gen_fn = trainer._generate  # prompts -> completions (model.generate and decoding)

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        res = gen_fn(*a, **k)
        cur["generate"] = cur.get("generate", 0.0) + time.perf_counter() - t0
        return res

    trainer._generate = timed_generate
    score = trainer._generate_and_score_completions

    def timed_score(*a, **k):
        res = score(*a, **k)
        cur["tokens"] = cur.get("tokens", 0) + int(res["completion_mask"].sum())
        return res

    trainer._generate_and_score_completions = timed_score

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            cur.clear()
            cur["t0"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            step = time.perf_counter() - cur.pop("t0")
            gen = cur.get("generate", 0.0)
            rec.append(
                {
                    "step": step,
                    "generate": gen,
                    "old_logprobs": None,
                    "train": step - gen,
                    "weight_sync": None,
                    "tokens": cur.get("tokens", 0),
                }
            )

    trainer.add_callback(Clock())
    trainer.train()
    Path(out).write_text(json.dumps(rec))


def _quickstart_data(w: dict) -> Path:
    """The quickstart recipe's own prompts (its arithmetic generator) as the GSM8K-style
    jsonl the TRL side reads, in a temporary file."""
    from posttrain.recipes.data import load_prompts
    from posttrain.recipes.loading import load_recipe

    recipe = load_recipe(ROOT / "recipes" / w["recipe"], ["eval=null"])
    lines = [
        json.dumps({"question": p.question, "answer": f"#### {p.ground_truth}"})
        for p in load_prompts(recipe.data)
    ]
    f = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
    f.write("\n".join(lines))
    f.close()
    return Path(f.name)


def _trl(args: argparse.Namespace, model_path: str) -> list[dict] | None:
    """TRL's steps (runs in `_trl.VENV`, made on first use), or None when --smoke finds no
    `_trl.VENV` (a smoke run installs nothing)."""
    py = trl_python(args.smoke)
    if py is None:
        return None
    data = str(_quickstart_data(SHAPES[args.shape])) if args.shape != "gsm8k" else args.data
    argv = [model_path, "--data", data, "--steps", str(args.steps), "--shape", args.shape]
    return run_trl_worker(py, __file__, argv)


# -- posttrain side ---------------------------------------------------------------------------
def _posttrain(args: argparse.Namespace) -> list[dict]:
    from posttrain.recipes.cli.checks import load_or_exit
    from posttrain.recipes.loop import run
    from posttrain.recipes.planning.layout import run_layout

    w = SHAPES[args.shape]
    data = [f"data.train.path={args.data}"] if args.shape == "gsm8k" else ["eval=null"]
    # `posttrain run`'s start-up path: the checked data and the learner layout it takes
    recipe, prompts = load_or_exit(
        ROOT / "recipes" / w["recipe"],
        [
            *args.smoke_sets,
            *data,
            f"train.steps={args.steps}",
            *overrides(w),
            *QUIET,
            *args.set,
        ],
    )
    recipe = run_layout(recipe, prompts)
    with tempfile.TemporaryDirectory() as tmp:
        hist = run(recipe, Path(tmp) / "run", data=prompts)
    return [
        {
            "step": h["time/step"],
            "generate": h["time/generate"],
            "old_logprobs": h.get("time/logprobs"),
            "train": h.get("time/train"),
            "weight_sync": h["time/weight_sync"],
            "tokens": h["response_length_mean"] * w["prompts"] * w["samples"],
        }
        for h in hist
    ]


def _table(
    runs: dict[str, list[dict]], loads: dict[str, list[str]], steps: int, shape: str
) -> None:
    def med(rs: list[dict], k: str) -> float | None:
        vals = [r[k] for r in rs[1:] if r.get(k) is not None]
        return statistics.median(vals) if vals else None

    def cell(v: float | None) -> str:
        return "—" if v is None else f"{v:.1f}"

    w = SHAPES[shape]
    model = "tiny random Llama" if shape == "smoke" else "SmolLM2-135M-Instruct"
    print(header())
    print(
        f"\n{shape}, {model}, {w['prompts']} prompts x {w['samples']} samples, "
        f"<= {w['new_tokens']} new tokens, KL 0, lr {w['lr']}; medians of steps 2..{steps}\n"
    )
    print(
        "| system | s/step (median) | generate | old logprobs | train | weight sync "
        "| generated tokens/s end to end |"
    )
    print("|---|---|---|---|---|---|---|")
    tps = {}
    for name, rs in runs.items():
        tps[name] = statistics.median(r["tokens"] / r["step"] for r in rs[1:])
        print(
            f"| {name} | {cell(med(rs, 'step'))} | {cell(med(rs, 'generate'))} | "
            f"{cell(med(rs, 'old_logprobs'))} | {cell(med(rs, 'train'))} | "
            f"{cell(med(rs, 'weight_sync'))} | {tps[name]:.1f} |"
        )
    if len(tps) == 2:
        trl, ours = tps.values()
        print(f"\nposttrain / TRL, generated tokens/s end to end: {ours / trl:.2f}x")
    for name, load in loads.items():
        print(f"load average (1/5/15 min) after {name}: {' '.join(load)}")
    print(f"posttrain: recipes/{w['recipe']} --set {' --set '.join(overrides(w))}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        ap = argparse.ArgumentParser()
        ap.add_argument("--trl-worker")
        ap.add_argument("--data")
        ap.add_argument("--steps", type=int)
        ap.add_argument("--save")
        ap.add_argument("--shape", default="gsm8k")
        a = ap.parse_args()
        _trl_worker(a.trl_worker, a.data, a.steps, a.save, SHAPES[a.shape])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="steps per system, first is warm-up")
    ap.add_argument(
        "--data",
        default=str(DATA),
        help="GSM8K train jsonl (question, answer); default: ../shared/data/gsm8k/ beside "
        "the repo, else the recipe's shipped sample",
    )
    ap.add_argument("--only", choices=["trl", "posttrain"], help="run one system")
    ap.add_argument("--save", type=Path, help="JSON of runs so far (with --only: merged)")
    ap.add_argument("--set", action="append", default=[], help="extra posttrain override")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument(
        "--shape",
        choices=sorted(set(SHAPES) - {"smoke"}),
        default="gsm8k",
        help="workload: issue 15's GSM8K one or the quickstart's",
    )
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first is warm-up)")
    from posttrain.common.model_registry import resolve_model_path

    args.smoke_sets = []
    if args.smoke:
        model = tiny_model()
        args.smoke_sets, args.shape, args.steps = tiny_run(model), "smoke", 2
        model_path = str(model)
    else:
        model_path = str(resolve_model_path("smollm2-135m-instruct"))
    saved = json.loads(args.save.read_text()) if args.save and args.save.exists() else {}
    runs, loads = saved.get("runs", {}), saved.get("loads", {})
    names = {
        "trl": "TRL 1.16.0 GRPOTrainer (1 process, all cores)",
        "posttrain": "posttrain (recipe's vLLM engine, learner and transport)",
    }
    for key in [args.only] if args.only else ["trl", "posttrain"]:
        got = _trl(args, model_path) if key == "trl" else _posttrain(args)
        if got is None:
            continue
        runs[names[key]] = got
        loads[names[key]] = Path("/proc/loadavg").read_text().split()[:3]
        if args.save:
            args.save.write_text(json.dumps({"runs": runs, "loads": loads}))
    _table({k: runs[k] for k in names.values() if k in runs}, loads, args.steps, args.shape)


if __name__ == "__main__":
    main()
