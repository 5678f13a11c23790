"""SFT against TRL's SFTTrainer on one workload: the loss of a fixed batch (float32) and
training tokens/s, side by side in one run.

    .venv/bin/python bench/sft.py [--steps 6] [--batch 16]
    .venv/bin/python bench/sft.py --smoke   # seconds: tiny model, both sides' code runs

Workload: `recipes/sft_tool_arith.yaml`'s conversations (system prompt, question, a
python tool call, its output, the number; generator tool_chats) on SmolLM2-135M-Instruct
(the built-in model's converted folder), assistant-only loss on both sides, `--batch`
conversations per step, lr 1e-4 constant, AdamW, max length 1024.

1. Loss of a fixed batch: the first `--batch` conversations, float32 on both sides, at
   the initial weights. posttrain: step 0's `loss` of a 1-step run of the recipe (its
   learner, FSDP2, packing on). TRL: `SFTTrainer.compute_loss` on its first batch
   (`assistant_only_loss=True`, no packing, `use_cpu`), the model's chat template with
   `{% generation %}` markers around each assistant reply and its `<|im_end|>\\n` (the
   tokens posttrain's mask covers, recipes/data/chats.py).
2. Throughput: `--steps` training steps of `--batch` new conversations each, bf16
   compute on both (TRL: `bf16=True`, fp32 weights under autocast; posttrain: the
   recipe's FSDP2 mixed precision, 2 learner ranks x 1 thread, or each of `--layouts`),
   tokens/s = real (non-padding) tokens of a step / its training time, median of steps
   2..N. TRL runs in its own virtualenv (`.bench-venv/trl`, made on first use as
   bench/vs_trl.py makes it) in one process with every core as torch threads, padding
   each batch to its longest conversation (its default, `packing=False`).

`--smoke`: a tiny random model, 2 steps of 2 conversations; TRL only when
`.bench-venv/trl` already exists (a smoke run installs nothing). It checks the bench runs
(tests/bench/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _header import header  # bench/ is sys.path[0] when a bench runs
from _quiet import QUIET
from _smoke import SMOKE_HELP, tiny_model
from _trl import run_trl_worker, trl_python

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "sft_tool_arith.yaml"
LR = 1e-4


def marked_template(template: str) -> str:
    """A ChatML template (`{{'<|im_start|>' + message['role'] + '\\n' + message['content']
    + '<|im_end|>' + '\\n'}}` per message, as SmolLM2's and the tiny model's) with the
    assistant reply and its closing inside `{% generation %}`, for TRL's assistant mask."""
    plain = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    tiny = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    if plain in template:
        marked = (
            "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
            "{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
            "{% else %}" + plain + "{% endif %}"
        )
        return template.replace(plain, marked)
    if tiny in template:
        marked = (
            "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
            "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}" + tiny + "{% endif %}"
        )
        return template.replace(tiny, marked)
    raise ValueError("not a ChatML template this bench knows how to mark")


# -- TRL side (runs inside .bench-venv/trl: imports nothing of posttrain) ---------------------
def _trl_worker(model_path: str, data: str, steps: int, batch: int, out: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.chat_template = marked_template(tok.chat_template)

    def trainer_for(ds_rows, bf16: bool, max_steps: int) -> SFTTrainer:
        args = SFTConfig(
            output_dir=tempfile.mkdtemp(prefix="trl-sft-bench-"),
            use_cpu=True,
            bf16=bf16,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=1,
            assistant_only_loss=True,
            packing=False,
            max_length=1024,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_steps=max_steps,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            seed=0,
            dataloader_num_workers=0,
        )
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        return SFTTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(ds_rows), processing_class=tok
        )

    fixed = trainer_for(rows[:batch], bf16=False, max_steps=1)
    inputs = next(iter(fixed.get_train_dataloader()))
    with torch.no_grad():
        loss = float(fixed.compute_loss(fixed.model, inputs))
    trainer = trainer_for(rows, bf16=True, max_steps=steps)
    rec: list[dict] = []
    cur: dict = {}
    step_fn = trainer.training_step

    def counted(model, inputs, *a, **k):
        cur["tokens"] = cur.get("tokens", 0) + int(inputs["attention_mask"].sum())
        return step_fn(model, inputs, *a, **k)

    trainer.training_step = counted

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            cur.clear()
            cur["t0"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            rec.append({"train": time.perf_counter() - cur.pop("t0"), "tokens": cur["tokens"]})

    trainer.add_callback(Clock())
    trainer.train()
    Path(out).write_text(json.dumps({"loss": loss, "steps": rec}))


def _trl(args: argparse.Namespace, model_path: str, data: Path) -> dict | None:
    """TRL's fixed-batch loss and steps (runs in `_trl.VENV`, made on first use), or None when
    --smoke finds no `_trl.VENV`."""
    py = trl_python(args.smoke)
    if py is None:
        return None
    argv = [model_path, "--data", str(data), "--steps", str(args.steps), "--batch", str(args.batch)]
    return run_trl_worker(py, __file__, argv)


# -- posttrain side ---------------------------------------------------------------------------
def _overrides(args: argparse.Namespace, size: int, steps: int, dtype: str) -> list[str]:
    base = [
        f"data.train.size={size}",
        "data.train.seed=1",
        f"train.steps={steps}",
        f"train.prompts_per_step={args.batch}",
        f"train.lr={LR}",
        "train.warmup_steps=0",
        "sft.eval_examples=0",
        f"model.dtype={dtype}",
        *QUIET,
    ]
    if args.smoke:
        base += [f"model.path={args.model}", "resources.learner.gpus=1"]
        base += ["resources.threads_per_worker=1", "sft.max_length=512"]
    return base


def _posttrain(args: argparse.Namespace, layout: str) -> dict:
    """posttrain's fixed-batch loss and steps; `layout` 'RxT' sets R learner ranks of T
    threads ('' keeps the recipe's)."""
    from posttrain.recipes.loading import load_recipe
    from posttrain.recipes.loop import run

    sets = []
    if layout:
        ranks, threads = layout.split("x")
        sets = [f"resources.learner.gpus={ranks}", f"resources.threads_per_worker={threads}"]
    with tempfile.TemporaryDirectory() as tmp:
        fixed = load_recipe(RECIPE, _overrides(args, args.batch, 1, "float32") + sets)
        loss = run(fixed, Path(tmp) / "fixed")[0]["loss"]
        sets_speed = _overrides(args, args.batch * args.steps, args.steps, "bfloat16") + sets
        hist = run(load_recipe(RECIPE, sets_speed), Path(tmp) / "speed")
    return {
        "loss": loss,
        "steps": [{"train": h["time/train"], "tokens": h["tokens"]} for h in hist],
    }


def _conversations(args: argparse.Namespace) -> tuple[Path, str]:
    """The recipe's conversations (as many as the throughput run trains on, the fixed
    batch first: the generator's first `--batch`) as a jsonl of `messages` rows, and the
    model folder."""
    from posttrain.common.model_registry import resolve_model_path
    from posttrain.recipes.data.generators import tool_chats
    from posttrain.recipes.loading import load_recipe

    r = load_recipe(RECIPE, _overrides(args, args.batch * args.steps, args.steps, "float32"))
    chats = tool_chats(r.data.train, r.model.system_prompt)
    # posttrain's 1-step run trains on the first `batch` (size = batch); TRL's fixed batch too
    f = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
    f.write("".join(json.dumps({"messages": c.messages}) + "\n" for c in chats))
    f.close()
    return Path(f.name), str(resolve_model_path(r.model.path))


def _table(runs: dict[str, dict], args: argparse.Namespace) -> None:
    model = "tiny random Llama" if args.smoke else "SmolLM2-135M-Instruct"
    print(header())
    print(
        f"\nsft_tool_arith conversations, {model}, {args.batch} conversations per step, "
        f"assistant-only loss; throughput: bf16 compute, medians of steps 2..{args.steps}\n"
    )
    print("| system | fixed-batch loss (fp32) | train s/step | tokens/step | tokens/s |")
    print("|---|---|---|---|---|")
    tps = {}
    for name, res in runs.items():
        steps = res["steps"][1:] or res["steps"]
        tps[name] = statistics.median(s["tokens"] / s["train"] for s in steps)
        print(
            f"| {name} | {res['loss']:.6f} | {statistics.median(s['train'] for s in steps):.2f} "
            f"| {statistics.median(s['tokens'] for s in steps):.0f} | {tps[name]:.0f} |"
        )
    if "TRL SFTTrainer" not in runs:
        return
    trl = runs["TRL SFTTrainer"]
    for name in (n for n in runs if n.startswith("posttrain")):
        print(
            f"\n{name}: |loss posttrain - loss TRL| = {abs(runs[name]['loss'] - trl['loss']):.2e}"
        )
        print(f"{name} / TRL, training tokens/s: {tps[name] / tps['TRL SFTTrainer']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument(
        "--layouts",
        default="",
        help="posttrain's learner layouts, e.g. 2x1,1x2 (R ranks x T threads)",
    )
    p.add_argument("--data", default="")
    p.add_argument("--save", default="")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.trl_worker:
        _trl_worker(args.trl_worker, args.data, args.steps, args.batch, args.save)
        return
    args.model = None
    if args.smoke:
        args.steps, args.batch = 2, 2
        args.model = str(tiny_model())
    data, model_path = _conversations(args)
    if args.smoke:
        model_path = args.model
    runs = {}
    trl = _trl(args, model_path, data)
    if trl is not None:
        runs["TRL SFTTrainer"] = trl
    layouts = args.layouts.split(",") if args.layouts and not args.smoke else [""]
    for layout in layouts:
        name = (
            f"posttrain ({layout.replace('x', ' rank(s) x ')} thread(s))" if layout else "posttrain"
        )
        runs[name] = _posttrain(args, layout)
    _table(runs, args)


if __name__ == "__main__":
    main()
