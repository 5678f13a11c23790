"""`posttrain plan --gpu cpu`'s measurements of this machine, a few seconds in all.

What is timed, each at the thread count the recipe's workers get (torch threads = the
cores a worker owns, common/process.py):
- `matmul_flops`: bf16 matmuls of the model's MLP shape (the learner's and the engine's
  compute dtype), FLOP/s.
- `copy_bytes_per_s`: a 256 MiB float32 tensor copied (bytes read + written per second),
  the memory bandwidth that bounds AdamW and a weight load.
- `loopback_bytes_per_s`: bytes through a TCP socket on 127.0.0.1, what gloo (the CPU
  backend of FSDP2's collectives and of the weight broadcast) rides on one host.
- `decode`: the real model (transformers, bf16) prefills the step's batch (up to 8
  tokens each) and decodes 4 tokens with its KV cache, at the rollout worker's threads
  (seconds per token: their median).
- `train`: one forward + backward of the real model on a small batch at a learner
  rank's threads (the first call, which builds kernels, is not timed).

Limits: the probes run in this process with whatever else the machine runs at the same
time (measure on an idle machine, or under the same load as the run); transformers'
decode is not vLLM's, so the decode probe is the HF engine's speed, and a vLLM engine's
ratio to it is what `bench/plan.py` shows.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from pathlib import Path

import torch

from posttrain.recipes.plan_cpu import CpuCalibration, DecodeProbe, TrainProbe

MIB = 2**20


def measure_matmul(
    threads: int, m: int, k: int, n: int, seconds: float = 0.3, windows: int = 5
) -> float:
    """bf16 FLOP/s of `[m, k] @ [k, n]` at `threads` torch threads (2·m·k·n FLOPs per
    product): the best of `windows` windows of about `seconds / windows` each, after one
    warm-up product (the best, as timeit takes the minimum: other jobs on the machine
    only ever slow a window down)."""
    torch.set_num_threads(threads)
    a = torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(k, n, dtype=torch.bfloat16)
    a @ b
    best = 0.0
    for _ in range(windows):
        reps, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds / windows or reps < 2:
            a @ b
            reps += 1
        best = max(best, 2 * m * k * n * reps / elapsed)
    return best


def measure_copy(nbytes: int = 256 * MIB, reps: int = 3) -> float:
    """Memory bandwidth, bytes/s: `reps` copies of an `nbytes` float32 tensor, each
    reading and writing `nbytes` (2·nbytes moved)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages faulted in before timing
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def measure_loopback(nbytes: int = 64 * MIB, chunk: int = 4 * MIB) -> float:
    """Bytes/s sent through a TCP connection on 127.0.0.1 (gloo's transport on one host),
    from a thread to this one."""
    payload = memoryview(bytearray(chunk))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def send() -> None:
            with socket.create_connection(server.getsockname()) as s:
                for _ in range(nbytes // chunk):
                    s.sendall(payload)

        sender = threading.Thread(target=send, daemon=True)
        t0 = time.perf_counter()
        sender.start()
        conn, _ = server.accept()
        buf, got = bytearray(chunk), 0
        with conn:
            while got < nbytes:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                got += n
        elapsed = time.perf_counter() - t0
        sender.join()
    return got / elapsed


def measure_decode(
    model: torch.nn.Module, threads: int, batch: int, prompt_tokens: int, steps: int = 4
) -> DecodeProbe:
    """Prefill `[batch, prompt_tokens]` random token ids, then `steps` one-token decode
    steps with the KV cache; seconds per step is their median. A one-token forward and
    the first decode step build kernels first and are not timed."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_tokens), generator=gen)
    with torch.no_grad():
        model(input_ids=ids[:1, :1], use_cache=True)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill = time.perf_counter() - t0
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        times = []
        for _ in range(steps):
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t0)
    return DecodeProbe(threads, batch, prompt_tokens, steps, prefill, statistics.median(times))


def measure_train(model: torch.nn.Module, threads: int, batch: int, seq: int) -> TrainProbe:
    """One timed forward + backward (mean token cross-entropy of `[batch, seq]` random
    ids on their own shift) after an untimed one on 8 tokens (kernels built)."""
    torch.set_num_threads(threads)
    ids = torch.randint(
        0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)
    )
    model.train()
    warm = ids[:1, :8]
    model(input_ids=warm, labels=warm, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return TrainProbe(threads, batch, batch * seq, elapsed)


def ram_bytes() -> float:
    """Physical memory of this machine, bytes (sysconf)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(
    model_folder: Path,
    hidden: int,
    intermediate: int,
    threads: set[int],
    decode_batch: int,
    prompt_tokens: int,
    rollout_threads: int,
    learner_threads: int,
    train_seq: int,
) -> CpuCalibration:
    """Every measurement above; the probes load the real model from `model_folder`.

    Args:
        hidden, intermediate: the model's MLP shape, for the matmul probe.
        threads: thread counts to time matmuls at (each worker's).
        decode_batch, prompt_tokens: the rollout engine's sequences per step and prompt
            length (the decode probe's batch).
        train_seq: prompt + response tokens of one training sequence.
    """
    t0 = time.perf_counter()
    before = torch.get_num_threads()
    try:
        rows = max(decode_batch, 64)
        flops = {t: measure_matmul(t, rows, hidden, intermediate) for t in sorted(threads)}
        torch.set_num_threads(learner_threads)  # AdamW runs at a learner rank's threads
        copy, loop = measure_copy(), measure_loopback()
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.bfloat16)
        # a prefill of up to 8 tokens per sequence: plan_cpu scales it to the prompt
        decode = measure_decode(model, rollout_threads, decode_batch, min(prompt_tokens, 8))
        train = measure_train(model, learner_threads, 2, train_seq)
    finally:
        torch.set_num_threads(before)
    return CpuCalibration(
        os.cpu_count() or 1, ram_bytes(), flops, copy, loop, decode, train, time.perf_counter() - t0
    )
