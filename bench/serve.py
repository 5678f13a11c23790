"""`posttrain serve`'s cost per training step, three ways alternated in one run:

1. SDK round trip: forward_backward + optim_step through the official SDK (HTTP,
   protobuf, futures) to the service;
2. in process: the same step called on the service's model object (no HTTP): 1 / 2 is
   the service's own overhead;
3. recipe learner: the step as a recipe's learner takes it (learner/models.py
   `load_sharded`: FSDP2 over one gloo rank, the same LoRA, `sequence_logprobs` per
   micro-batch of `--micro-batch` rows, AdamW), on the same tokens.

    .venv/bin/python bench/serve.py [--repeats 5] [--batch 32] [--length 64]
        [--dtype bfloat16] [--micro-batch 16] [--smoke]

The service runs in this process (uvicorn in a thread) on the real model; the batch is
`--batch` random datums of `--length` tokens with the `importance_sampling` inputs.
Medians over the repeats after a warm-up round. `--smoke`: the tiny random model,
2 repeats (tests/bench/).
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


def serve(path: Path, dtype: str) -> tuple[str, object]:
    """Base URL and state of a service on a free port serving `path` as 'm'."""
    import uvicorn

    from posttrain.common.net import listen_socket
    from posttrain.service.app import create_app

    app = create_app(TOKEN, scratch(), {"m": path}, dtype)
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    time.sleep(1.0)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.service


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    import numpy as np
    import tinker
    from tinker import types

    from posttrain.common.model_registry import resolve_model_path
    from posttrain.service.training import Adam
    from posttrain.service.wire import WireDatum

    path = tiny_model() if args.smoke else resolve_model_path(args.model)
    if args.smoke:
        args.repeats, args.batch, args.length, args.micro_batch = 2, 4, 16, 2
    url, state = serve(path, args.dtype)
    tc = (
        tinker.ServiceClient(base_url=url, api_key=TOKEN)
        .create_lora_training_client(base_model="m", rank=args.rank, seed=0)
        .result()
    )
    model = state.models[tc.model_id]
    rng = np.random.default_rng(0)
    rows = rng.integers(5, min(model.vocab, 5000), size=(args.batch, args.length + 1))
    inputs = [
        {
            "target_tokens": r[1:],
            "logprobs": np.full(args.length, -2.0, np.float32),
            "advantages": rng.normal(size=args.length).astype(np.float32),
        }
        for r in rows
    ]
    sdk_data = [
        types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()), loss_fn_inputs=i)
        for r, i in zip(rows, inputs, strict=True)
    ]
    wire = [WireDatum(r[:-1].astype(np.int64), i) for r, i in zip(rows, inputs, strict=True)]
    adam = types.AdamParams(learning_rate=1e-6)
    import torch

    recipe = learner_step(path, args.rank, args.dtype, args.micro_batch)
    ids_t = torch.from_numpy(rows)
    old_t = torch.full((args.batch, args.length), -2.0)
    adv_t = torch.from_numpy(np.stack([i["advantages"] for i in inputs]))
    times: dict[str, list[float]] = {"SDK round trip": [], "in process": [], "recipe learner": []}
    for _ in range(args.repeats + 1):  # the first pair warms up and is dropped
        t0 = time.perf_counter()
        fb = tc.forward_backward(sdk_data, "importance_sampling")
        op = tc.optim_step(adam)
        fb.result()
        op.result()
        times["SDK round trip"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        model.forward_backward(wire, "importance_sampling", {}, False)
        model.optim_step(Adam(1e-6, 0.9, 0.95, 1e-12, 0.0, 0.0))
        times["in process"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        recipe(ids_t, old_t, adv_t)
        times["recipe learner"].append(time.perf_counter() - t0)
    print(header())
    print(
        f"# model {path.name}, LoRA r{args.rank}, {args.dtype} compute, batch {args.batch} x "
        f"{args.length} tokens (recipe learner: micro-batches of {args.micro_batch} rows)"
    )
    base = statistics.median(times["recipe learner"][1:])
    print("| path | s/step (median) | vs recipe learner |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        print(f"| {name} | {med:.3f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
