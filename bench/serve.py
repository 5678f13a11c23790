"""`posttrain serve` on the roles, measured side by side in one run:

1. **Round trip vs recipe**: one session's forward_backward + optim_step through the SDK
   (HTTP, protobuf, queue, the learner group's session verbs), alternated with the same
   step as a recipe's learner takes it (learner/models.py `load_sharded`: FSDP2 on one
   gloo rank in this process, the same LoRA rank, micro-batches, AdamW).
2. **Sessions at once vs in turn**: `--sessions` sessions each sending forward_backward
   on `--batch` sequences at the same time (on a service with `sessions.batch` =
   `--sessions`, which runs the requests that wait together as one learner pass),
   against the same requests sent one session after another; training tokens/s.
3. **Memory per session**: resident memory (RSS) of the learner rank and of the engine
   with 1 session and with `--sessions` sessions (each trained one step and its sampler
   pushed).
4. **Sampling on the engines**: `--samples` samples of one prompt on the service with
   the `hf` engine (the engine the in-process service sampled with) and with `vllm`.

    .venv/bin/python bench/serve.py [--repeats 3] [--batch 8] [--length 64] [--sessions 4]
        [--dtype bfloat16] [--smoke]

The services run in this process (uvicorn in a thread) over an embedded Ray cluster with
1 learner rank and 1 engine; medians over the repeats after a warm-up round. `--smoke`:
the tiny random model, 1 repeat, `hf` only (tests/bench/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP, scratch, tiny_model  # noqa: E402

TOKEN = "tml-bench"


def learner_step(path: Path, rank: int, dtype: str, micro: int):  # noqa: ANN201
    """A recipe learner's policy (FSDP2 on one gloo rank, LoRA `rank`) and a function
    running one importance-sampling step on `[B, T]` ids."""
    import torch
    import torch.distributed as dist

    from posttrain.common.net import listen_socket
    from posttrain.learner.adapters import AdapterSettings
    from posttrain.learner.logprobs import sequence_logprobs
    from posttrain.learner.models import load_sharded

    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    adapter = AdapterSettings(type="lora", r=rank, alpha=float(rank))
    model = load_sharded(str(path), 1, dtype, "policy", adapter=adapter)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95))

    def step(ids: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> None:
        for rows in torch.arange(ids.shape[0]).split(micro):
            lp = sequence_logprobs(model, ids[rows], torch.ones_like(ids[rows]), 1)[:, 1:]
            (-(torch.exp(lp - old[rows]) * adv[rows]).sum()).backward()
        torch.nn.utils.clip_grad_norm_(params, float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def start(path: Path, engine: str, dtype: str, rank: int, micro: int, batch: int = 1):  # noqa: ANN201
    """(url, state, stop) of a service on a free port serving `path` as 'm'."""
    import uvicorn

    from posttrain.common.net import listen_socket
    from posttrain.config.service import ServiceConfig
    from posttrain.service.app import create_app
    from posttrain.service.state import ServiceState

    cfg = ServiceConfig.model_validate(
        {
            "model": {"path": str(path), "name": "m", "dtype": dtype},
            "rollout": {"engine": engine},
            "sessions": {"max_rank": rank, "micro_batch_size": micro, "batch": batch},
        }
    )
    state = ServiceState.start(cfg, scratch(), TOKEN)
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    time.sleep(1.0)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        state.stop()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", state, stop


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def actor_pid(actor) -> int:  # noqa: ANN001
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def main() -> None:  # noqa: PLR0915 (one table per phase, in order)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument(
        "--only-at-once", action="store_true", help="measure only 2. (sessions at once vs in turn)"
    )
    args = ap.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    import numpy as np
    import tinker
    import torch
    from tinker import types

    from posttrain.common.model_registry import resolve_model_path

    path = tiny_model() if args.smoke else resolve_model_path(args.model)
    engines = ["hf"] if args.smoke else ["hf", "vllm"]
    if args.smoke:
        args.repeats, args.batch, args.length, args.micro_batch = 1, 4, 16, 2
        args.rank, args.sessions, args.samples = 4, 2, 4
    rng = np.random.default_rng(0)
    rows = rng.integers(5, 5000 if not args.smoke else 60, size=(args.batch, args.length + 1))
    adv = rng.normal(size=(args.batch, args.length)).astype(np.float32)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1].tolist()),
            loss_fn_inputs={
                "target_tokens": r[1:],
                "logprobs": np.full(args.length, -2.0, np.float32),
                "advantages": a,
            },
        )
        for r, a in zip(rows, adv, strict=True)
    ]
    adam = types.AdamParams(learning_rate=1e-6)
    tables: list[str] = []
    if args.only_at_once:
        tables.append(sessions_at_once(path, data, args))
        print(header())
        print(f"# model {path.name}, LoRA r{args.rank}, {args.dtype} compute, 1 learner rank")
        print("\n\n".join(tables))
        return
    url, state, stop = start(path, engines[0], args.dtype, args.rank, args.micro_batch)
    try:
        client = tinker.ServiceClient(base_url=url, api_key=TOKEN)
        tcs = [
            client.create_lora_training_client(base_model="m", rank=args.rank, seed=i).result()
            for i in range(args.sessions)
        ]
        learner_pid = actor_pid(state.stack.roles.learners[0])
        engine_pid = actor_pid(state.stack.roles.rollout[0])

        def one_step(tc) -> None:  # noqa: ANN001
            fb = tc.forward_backward(data, "importance_sampling")
            op = tc.optim_step(adam)
            fb.result()
            op.result()

        # 3. memory: one session trained and sampled, then all of them
        one_step(tcs[0])
        tcs[0].save_weights_and_get_sampling_client().result()
        mem1 = (rss_mb(learner_pid), rss_mb(engine_pid))
        for tc in tcs[1:]:
            one_step(tc)
            tc.save_weights_and_get_sampling_client().result()
        memn = (rss_mb(learner_pid), rss_mb(engine_pid))
        # 1. round trip vs recipe learner, alternated
        recipe = learner_step(path, args.rank, args.dtype, args.micro_batch)
        ids_t = torch.from_numpy(rows)
        old_t = torch.full((args.batch, args.length), -2.0)
        adv_t = torch.from_numpy(adv)
        trip: dict[str, list[float]] = {"SDK round trip (service)": [], "recipe learner": []}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            t0 = time.perf_counter()
            one_step(tcs[0])
            trip["SDK round trip (service)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            recipe(ids_t, old_t, adv_t)
            trip["recipe learner"].append(time.perf_counter() - t0)
        base = statistics.median(trip["recipe learner"][1:])
        t = ["| path | s/step (median) | vs recipe learner |", "|---|---|---|"]
        for name, ts in trip.items():
            med = statistics.median(ts[1:])
            t.append(f"| {name} | {med:.3f} | {med / base:.2f}x |")
        tables.append("\n".join(t))
        t = ["| RSS MiB | 1 session | " + f"{args.sessions} sessions | per added session |"]
        t.append("|---|---|---|---|")
        for i, who in enumerate(("learner rank 0", "engine 0")):
            per = (memn[i] - mem1[i]) / max(args.sessions - 1, 1)
            t.append(f"| {who} | {mem1[i]:.0f} | {memn[i]:.0f} | {per:.1f} |")
        tables.append("\n".join(t))
        sample_rows = {engines[0]: sample_rate(tcs[0], args, types)}
    finally:
        stop()
    tables.insert(1, sessions_at_once(path, data, args))
    for engine in engines[1:]:
        url, state, stop = start(path, engine, args.dtype, args.rank, args.micro_batch)
        try:
            client = tinker.ServiceClient(base_url=url, api_key=TOKEN)
            tc = client.create_lora_training_client(base_model="m", rank=args.rank).result()
            sample_rows[engine] = sample_rate(tc, args, types)
        finally:
            stop()
    t = ["| engine | sampled tokens/s | vs hf |", "|---|---|---|"]
    for engine, rate in sample_rows.items():
        t.append(f"| {engine} | {rate:.1f} | {rate / sample_rows['hf']:.2f}x |")
    tables.append("\n".join(t))
    print(header())
    print(
        f"# model {path.name}, LoRA r{args.rank}, {args.dtype} compute, batch {args.batch} x "
        f"{args.length} tokens, 1 learner rank, 1 engine"
    )
    print("\n\n".join(tables))


def sessions_at_once(path: Path, data: list, args: argparse.Namespace) -> str:
    """2.: on a service batching up to `--sessions` sessions' requests."""
    import tinker

    url, state, stop = start(path, "hf", args.dtype, args.rank, args.micro_batch, args.sessions)
    try:
        client = tinker.ServiceClient(base_url=url, api_key=TOKEN)
        tcs = [
            client.create_lora_training_client(base_model="m", rank=args.rank, seed=i).result()
            for i in range(args.sessions)
        ]
        return at_once_table(tcs, data, args, state.stack)
    finally:
        stop()


def at_once_table(tcs, data, args, stack) -> str:  # noqa: ANN001
    """`--sessions` sessions' forward_backward sent one after another, then all at once
    (the service batches those that wait together), alternated; training tokens/s, the
    learner passes per round and where a round's time went: learner rank 0's `forward`
    and `backward` spans, the rest (HTTP, queue, Ray, slot copies, loss) by difference."""
    import ray

    tokens = args.sessions * args.batch * args.length
    modes = ("in turn", "at once")
    wall: dict[str, list[float]] = {m: [] for m in modes}
    passes: dict[str, list[int]] = {m: [] for m in modes}
    spans: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    learner = stack.roles.learners[0]

    def ran() -> int:
        return stack.counts.learner_verbs.get(0, {}).get("forward_backward", 0)

    def timed(mode: str, send) -> None:  # noqa: ANN001
        ray.get(learner.drain_spans.remote())
        t0, n0 = time.perf_counter(), ran()
        send()
        wall[mode].append(time.perf_counter() - t0)
        passes[mode].append(ran() - n0)
        got = ray.get(learner.drain_spans.remote())
        fwd, bwd = (
            sum(s.end - s.start for s in got if s.kind == k) for k in ("forward", "backward")
        )
        spans[mode].append((fwd, bwd))

    def in_turn() -> None:
        for tc in tcs:
            tc.forward_backward(data, "importance_sampling").result()

    def at_once() -> None:
        for f in [tc.forward_backward(data, "importance_sampling") for tc in tcs]:
            f.result()

    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        timed("in turn", in_turn)
        timed("at once", at_once)
    t = [
        f"| {args.sessions} sessions x {args.batch} seqs (sessions.batch {args.sessions}) "
        "| s (median) | train tokens/s | vs in turn | learner passes per round "
        "| forward s | backward s | rest s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    turn = statistics.median(wall["in turn"][1:])
    for mode in modes:
        med = statistics.median(wall[mode][1:])
        fwd = statistics.median(f for f, _ in spans[mode][1:])
        bwd = statistics.median(b for _, b in spans[mode][1:])
        t.append(
            f"| {mode} | {med:.3f} | {tokens / med:.0f} | {turn / med:.2f}x "
            f"| {'/'.join(str(n) for n in passes[mode][1:])} | {fwd:.3f} | {bwd:.3f} "
            f"| {med - fwd - bwd:.3f} |"
        )
    return "\n".join(t)


def sample_rate(tc, args, types) -> float:  # noqa: ANN001
    """Sampled tokens per second of `--samples` samples of one prompt, median of repeats
    after a warm-up."""
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(list(range(5, 21)))
    params = types.SamplingParams(max_tokens=32, temperature=1.0, seed=0)
    rates = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        out = sampler.sample(prompt, args.samples, params).result()
        n = sum(len(s.tokens) for s in out.sequences)
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates[1:])


if __name__ == "__main__":
    main()
