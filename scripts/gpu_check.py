"""The GPU check (run by scripts/gpu_check.sh): posttrain's learner, HF engine and CUDA-IPC
hand-off on one GPU, then the `gpu` tests; prints one table.

Needs only torch (a CUDA build), transformers, peft and pytest: it imports posttrain's
learner-side modules straight from this checkout (no install, no pydantic, Ray, vLLM or
FastAPI) and builds its model from a config (no download).

Rows:
  1. learner: `LearnerWorker` world size 1 (FSDP2, NCCL + gloo group, bf16 compute, fp32
     master weights, AdamW), a TinyLlama-shaped ~1.1B Llama, sequences of 2,048, 4,096 and
     8,192 tokens, with and without gradient checkpointing: step time (mean of the timed steps
     after one warm-up step, the GRPO loss' forward + backward + optimizer), tokens/s,
     MFU = 6·N·tokens/s / peak, N the parameter count (attention's s² FLOPs not counted,
     so MFU is a lower bound), peak = 989 TFLOPS, the H200's dense BF16 Tensor Core
     peak (NVIDIA H200 datasheet: 1,979 TFLOPS with 2:4 sparsity, half of it dense), and
     beside it MFU over the measured peak of row 0;
  0. bf16 matmul peak, measured: `F.linear` at the model's MLP shape (16,384 tokens x
     2,048 -> 5,632), TFLOP/s (bench/learner.py's CPU peak, on the GPU);
  2. HF engine (`actors/hf_engine.HFEngine`) sampling tokens/s on the same model;
  3. CUDA-IPC hand-off of the model's bf16 weights to another process on the same GPU
     (`weightsync/cuda_ipc`: share, open, copy into the receiver's own tensors) against a
     device-to-device copy of the same tensors in one process;
  4. `pytest -m gpu` on the GPU test files.
Without CUDA every row says it was skipped and the script exits 0 (after running the
test files, whose `gpu` tests skip).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0  # H200 SXM, dense BF16
GPU_TESTS = ["tests/weightsync/test_cuda_ipc.py", "tests/learner/test_devices_learner.py"]


def _import_posttrain() -> None:
    """Make `posttrain.*` importable from this checkout without installing it (the
    package maps posttrain.X to the folder X/)."""
    try:
        import posttrain.learner  # noqa: F401
    except ImportError:
        link_dir = Path(tempfile.mkdtemp(prefix="posttrain-gpucheck-"))
        (link_dir / "posttrain").symlink_to(ROOT)
        sys.path.insert(0, str(link_dir))
        os.environ["PYTHONPATH"] = f"{link_dir}:{os.environ.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(ROOT))  # tests.tiny_model


def build_model(folder: Path) -> int:
    """A ~1.1B Llama (TinyLlama's shape) with random bf16 weights and the tests'
    character tokenizer in `folder`; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_model import build_tiny_model

    build_tiny_model(folder)  # tokenizer + chat template; config/weights replaced below
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=3,
        pad_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return n


def _batch(rows: int, seq: int, prompt: int = 128):
    import torch

    from posttrain.algorithms.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 32000, (rows, seq), generator=g)
    resp = torch.zeros(rows, seq)
    resp[:, prompt:] = 1.0
    return TrainBatch(
        ids,
        torch.ones(rows, seq, dtype=torch.long),
        resp,
        prompt,
        advantages=torch.randn(rows, 1, generator=g) * resp,
        loss_denominator=float(resp.sum()),
    )


def matmul_row() -> tuple[list[str], float]:
    """Row 0 and the measured bf16 matmul rate, FLOP/s (mean of 20 calls after 3)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        F.linear(x, w)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        F.linear(x, w)
    torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / 20
    rate = 2 * 16384 * 2048 * 5632 / secs
    row = ["bf16 matmul peak (measured)", f"{secs * 1e3:.2f} ms", f"{rate / 1e12:.0f} TFLOP/s"]
    return [*row, f"{100 * rate / (PEAK_TFLOPS * 1e12):.0f}% of datasheet"], rate


def learner_rows(model: Path, n_params: int, steps: int, measured: float) -> list[list[str]]:
    import torch

    from posttrain.common.net import free_port
    from posttrain.learner.worker import LearnerSettings, LearnerWorker

    out = []
    for ckpt in (False, True):
        w = LearnerWorker(
            0,
            1,
            LearnerSettings(
                model_path=str(model),
                compute_dtype="bfloat16",
                lr=1e-6,
                micro_batch_size=1,
                device="cuda",
                gradient_checkpointing=ckpt,
            ),
            threads=4,
        )
        w.setup(free_port())
        for seq in (2048, 4096, 8192):
            batch = _batch(4 if seq < 8192 else 2, seq)
            batch.old_logprobs = w.compute(batch, 0, "old_logprobs")
            torch.cuda.reset_peak_memory_stats()
            times = []
            for i in range(steps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                w.train_step(batch, step=i)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            step_s = sum(times[1:]) / steps
            tps = batch.input_ids.numel() / step_s
            mfu = 6 * n_params * tps / (PEAK_TFLOPS * 1e12)
            peak = torch.cuda.max_memory_allocated() / 2**30
            out.append(
                [
                    f"learner seq {seq}{' +ckpt' if ckpt else ''}",
                    f"{step_s:.3f} s/step",
                    f"{tps:,.0f} tok/s",
                    f"MFU {100 * mfu:.1f}% ({100 * mfu * PEAK_TFLOPS * 1e12 / measured:.1f}%"
                    f" of measured), peak {peak:.1f} GiB",
                ]
            )
        w.close()
    return out


def engine_row(model: Path) -> list[str]:
    import torch

    from posttrain.actors.hf_engine import HFEngine
    from posttrain.actors.rollout import SamplingSettings

    eng = HFEngine(str(model), dtype="bfloat16", device="cuda")
    prompts = [[5 + (i * 7 + j) % 90 for j in range(32)] for i in range(32)]
    sampling = SamplingSettings(n=1, max_new_tokens=256, seed=0)
    eng.generate(prompts[:2], SamplingSettings(n=1, max_new_tokens=8))  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    groups = eng.generate(prompts, sampling)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for g in groups for s in g)
    del eng
    torch.cuda.empty_cache()
    return [
        "HF engine generate",
        f"{dt:.2f} s",
        f"{tokens / dt:,.0f} tok/s",
        f"{len(prompts)} prompts x {sampling.max_new_tokens} new tokens",
    ]


def _receiver(entries, meta, queue) -> None:
    import torch

    from posttrain.weightsync.cuda_ipc import open_shared

    torch.cuda.set_device(0)
    # The engine's own weights; from shapes, so the timed open is the first one.
    own = {n: torch.empty(shape, dtype=dtype, device="cuda") for n, shape, dtype in meta}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opened = list(open_shared(entries))
    t1 = time.perf_counter()
    for name, t in opened:
        own[name].copy_(t)
    torch.cuda.synchronize()
    queue.put((t1 - t0, time.perf_counter() - t0))


def ipc_row(model: Path) -> list[str]:
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from posttrain.weightsync.cuda_ipc import share

    weights = {
        n: p.detach()
        for n, p in AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
        .to("cuda")
        .named_parameters()
    }
    gib = sum(t.numel() * t.element_size() for t in weights.values()) / 2**30
    dst = {n: torch.empty_like(t) for n, t in weights.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for n, t in weights.items():
        dst[n].copy_(t)
    torch.cuda.synchronize()
    d2d = time.perf_counter() - t0
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t_share = time.perf_counter()
    entries = share(weights)
    t_share = time.perf_counter() - t_share
    meta = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
    proc = ctx.Process(target=_receiver, args=(entries, meta, queue))
    proc.start()
    deadline = time.time() + 300
    while True:  # the child's result, or its death
        try:
            opened, total = queue.get(timeout=5)
            break
        except Empty:
            if not proc.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the IPC receiver died (exit {proc.exitcode})") from None
    proc.join(60)
    return [
        "CUDA-IPC hand-off",
        f"{t_share + total:.3f} s",
        f"{gib / (t_share + total):.0f} GiB/s",
        f"{gib:.2f} GiB: share {t_share * 1e3:.0f} ms, open {opened * 1e3:.0f} ms, "
        f"open+copy {total * 1e3:.0f} ms; d2d copy {d2d * 1e3:.0f} ms",
    ]


def pytest_row() -> list[str]:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode not in (0, 5):  # 5: nothing collected
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
    return [
        "pytest -m gpu",
        f"{time.perf_counter() - t0:.0f} s",
        "ok" if done.returncode in (0, 5) else f"FAILED (exit {done.returncode})",
        summary,
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed learner steps per row")
    args = ap.parse_args()
    _import_posttrain()
    import torch

    rows: list[list[str]] = []
    cuda = torch.cuda.is_available()
    if cuda:
        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
        with tempfile.TemporaryDirectory(prefix="posttrain-gpucheck-model-") as d:
            folder = Path(d) / "model"
            n = build_model(folder)
            print(f"model: {n / 1e9:.2f}B parameters, built from its config", flush=True)
            row, measured = matmul_row()
            rows.append(row)
            print(row, flush=True)
            for part in (
                lambda: learner_rows(folder, n, args.steps, measured),
                lambda: [engine_row(folder)],
                lambda: [ipc_row(folder)],
            ):
                rows += part()
                print(rows[-1], flush=True)
    else:
        print(
            f"no CUDA device (torch {torch.__version__}): learner, engine and CUDA-IPC rows "
            "skipped",
            flush=True,
        )
        rows += [
            [name, "skipped", "-", "no CUDA device"]
            for name in (
                "bf16 matmul peak (measured)",
                "learner (FSDP2+NCCL, ~1.1B, seq 2048/4096/8192, +/- ckpt)",
                "HF engine generate",
                "CUDA-IPC hand-off",
            )
        ]
    rows.append(pytest_row())
    head = ["check", "time", "rate", "notes"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    print("\n" + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return 0 if "FAILED" not in rows[-1][2] else 1


if __name__ == "__main__":
    sys.exit(main())
