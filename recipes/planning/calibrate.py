"""`posttrain plan --gpu cpu`'s measurements of this machine, cached per machine and
recipe shape by recipes/planning/calibration_cache.py.

What is timed, each at the thread count the recipe's workers get (torch threads = the
cores a worker owns, common/process.py):
- `matmul_flops`: matmuls of the model's MLP shape in `model.dtype` (the learner's and
  the engine's compute dtype: a CPU without bf16 instructions runs bf16 several times
  slower than float32), FLOP/s.
- `copy_bytes_per_s`: a 256 MiB float32 tensor copied (bytes read + written per second).
- `loopback_bytes_per_s`: bytes through a TCP socket on 127.0.0.1, what gloo (the CPU
  backend of FSDP2's collectives and of the weight broadcast) rides on one host.
- `decode`: the recipe's own engine (`rollout.engine`, built as a rollout worker builds
  it) prefills the step's prompts and decodes a few tokens per sequence, at the rollout
  worker's threads. vLLM and transformers differ several-fold here, so neither stands in
  for the other; building a vLLM engine is most of the calibration's time (~10 s).
- `push`: the same engine's `load_weights` of the model's own tensors, and the latency of
  a small all-gather between two gloo ranks (two threads of this process).
- `train`: one forward + backward of the real model on about 256 tokens at a learner
  rank's threads (the first call, which builds kernels, is not timed).
- `adamw_s_per_param`: one AdamW step over fp32 tensors of the model's shapes, each cut
  to one learner rank's shard.

Limits: the probes run in this process with whatever else the machine runs at the same
time (measure on an idle machine, or under the same load as the run); a cached
calibration is only as good as the load it was measured under (its time is shown).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import socket
import threading
import time
from pathlib import Path

import torch

from ...config import Recipe
from .cpu import (
    CpuCalibration,
    DecodeProbe,
    PushProbe,
    TrainProbe,
    worker_threads,
)
from .shape import ModelShape

MIB = 2**20


def measure_matmul(
    threads: int,
    m: int,
    k: int,
    n: int,
    seconds: float = 0.3,
    windows: int = 5,
    dtype: torch.dtype = torch.bfloat16,
) -> float:
    """FLOP/s of `[m, k] @ [k, n]` in `dtype` at `threads` torch threads (2·m·k·n FLOPs per
    product): the best of `windows` windows of about `seconds / windows` each, after one
    warm-up product (the best, as timeit takes the minimum: other jobs on the machine
    only ever slow a window down)."""
    torch.set_num_threads(threads)
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
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


def measure_collective(reps: int = 64) -> float:
    """Seconds of one all-gather of 64 bf16 values between two gloo ranks (two threads of
    this process, meeting in an in-memory store): the per-tensor latency of a push's
    gather, whatever its bytes."""
    import torch.distributed as dist

    store = dist.HashStore()
    groups: list = [None, None]
    times: list[float] = [0.0, 0.0]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))

    def loop(rank: int) -> None:
        x = torch.ones(64, dtype=torch.bfloat16)
        out = [torch.empty_like(x), torch.empty_like(x)]
        groups[rank].allgather([out], [x]).wait()
        t0 = time.perf_counter()
        for _ in range(reps):
            groups[rank].allgather([out], [x]).wait()
        times[rank] = (time.perf_counter() - t0) / reps

    for fn in (join, loop):
        threads = [threading.Thread(target=fn, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return max(times)


def measure_engine(
    engine,
    kind: str,
    threads: int,
    prompts: int,
    n: int,
    prompt_tokens: int,
    vocab: int,
    weights: dict[str, torch.Tensor],
    steps: int = 8,
) -> tuple[DecodeProbe, PushProbe]:
    """Time `engine` (an `InferenceEngine` of `kind` 'vllm' or 'hf') as a step uses it:
    `prompts` random prompts of `prompt_tokens` tokens (ids below `vocab`), `n` samples
    each. One call with 1 new token gives the prefill; a second on fresh prompts (no
    prefix-cache hits) with 1 + `steps` new tokens gives the seconds per decode step (over
    the longest response it made). Then one untimed and one timed `load_weights(weights)`.
    A one-prompt call first builds kernels."""
    from ...actors.rollout import SamplingSettings

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)

    def batch(count: int) -> list[list[int]]:
        ids = torch.randint(32, max(33, vocab - 32), (count, prompt_tokens), generator=gen)
        return ids.tolist()

    def timed(rows: list[list[int]], new: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        groups = engine.generate(rows, SamplingSettings(n=n, max_new_tokens=new))
        longest = max(len(s.token_ids) for g in groups for s in g)
        return time.perf_counter() - t0, longest

    timed(batch(1), 2)
    prefill, _ = timed(batch(prompts), 1)
    both, longest = timed(batch(prompts), 1 + steps)
    made = max(1, longest - 1)
    decode = DecodeProbe(
        kind, threads, prompts * n, prompt_tokens, made, prefill, max(0.0, both - prefill) / made
    )
    engine.load_weights(weights.items())
    t0 = time.perf_counter()
    engine.load_weights(weights.items())
    load = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return decode, PushProbe(load, float(nbytes), 0.0, len(weights))


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


def measure_adamw(model: torch.nn.Module, ranks: int, threads: int) -> float:
    """Seconds per parameter of one AdamW step (torch's default implementation, as the
    learner's) over fp32 tensors shaped as `model`'s parameters, each cut to 1/`ranks` of
    its elements (one FSDP2 rank's shard); the first step (state allocation) untimed."""
    torch.set_num_threads(threads)
    shards = [
        torch.nn.Parameter(torch.zeros(-(-p.numel() // ranks), dtype=torch.float32))
        for p in model.parameters()
    ]
    for p in shards:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(shards, lr=1e-6)
    opt.step()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return min(times) / sum(p.numel() for p in shards)


def calibrate(r: Recipe, folder: Path, prompt_tokens: int, shape: ModelShape) -> CpuCalibration:
    """Every measurement above for recipe `r` (its engine, its workers' threads, its
    step's batch); the probes load the real model from `folder`.

    Args:
        prompt_tokens: the longest prompt after the chat template.
        shape: the model's sizes (its MLP shape for the matmul probe, its vocabulary
            for the engine probe's random prompts).
    """
    t0 = time.perf_counter()
    cores = os.cpu_count() or 1
    t_r, t_l = worker_threads(r, cores)
    res = r.resources
    engines = res.rollout.engines
    prompts = -(-r.train.prompts_per_step // engines)
    n = r.rollout.samples_per_prompt
    before = torch.get_num_threads()
    try:
        dtype = getattr(torch, r.model.dtype)
        flops = {
            t: measure_matmul(
                t, max(prompts * n, 64), shape.hidden, shape.intermediate, dtype=dtype
            )
            for t in sorted({t_r, t_l})
        }
        torch.set_num_threads(t_l)  # AdamW and the FSDP2 copies run at a learner's threads
        copy, loop, latency = measure_copy(), measure_loopback(), measure_collective()
        decode, push = _engine_probe(r, folder, dtype, t_r, prompts, prompt_tokens, shape.vocab)
        push = dataclasses.replace(push, collective_s=latency)
        train, adamw = _learner_probes(r, folder, dtype, t_l, prompt_tokens)
    finally:
        torch.set_num_threads(before)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return CpuCalibration(
        cores,
        ram_bytes(),
        flops,
        copy,
        loop,
        decode,
        train,
        push,
        adamw,
        time.perf_counter() - t0,
        now,
    )


def _engine_probe(
    r: Recipe,
    folder: Path,
    dtype: torch.dtype,
    threads: int,
    prompts: int,
    prompt_tokens: int,
    vocab: int,
) -> tuple[DecodeProbe, PushProbe]:
    """`measure_engine` on the recipe's engine loaded from `folder`, its weights in
    `dtype`; the engine and weights are freed before returning (the learner's probes
    follow)."""
    from safetensors.torch import load_file

    from ...actors.factory import make_engine
    from ..roles import engine_settings

    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    settings = engine_settings(r, str(folder))
    engine = make_engine(settings)
    n = r.rollout.samples_per_prompt
    decode, push = measure_engine(
        engine, settings.kind, threads, prompts, n, prompt_tokens, vocab, weights
    )
    del engine, weights  # its KV cache and weights before the learner's probes
    gc.collect()
    return decode, push


def _learner_probes(
    r: Recipe, folder: Path, dtype: torch.dtype, threads: int, prompt_tokens: int
) -> tuple[TrainProbe, float]:
    """`measure_train` (a few sequences of the step's length) and `measure_adamw` on
    the model loaded from `folder` in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    seq = prompt_tokens + r.rollout.max_new_tokens
    train = measure_train(model, threads, max(2, -(-256 // seq)), seq)
    adamw = measure_adamw(model, r.resources.learner.gpus, threads)
    return train, adamw
