"""`posttrain serve`'s cost per training step: a forward_backward + optim_step round trip
through the official SDK (HTTP, protobuf, futures) against the same step called in
process on the same model object, alternated in one run.

    .venv/bin/python bench/serve.py [--repeats 5] [--batch 32] [--length 64] [--smoke]

The service runs in this process (uvicorn in a thread) on the real model; the batch is
`--batch` random datums of `--length` tokens with the `importance_sampling` inputs. The
table gives the median seconds per step and the ratio to the in-process step (the
service's overhead). `--smoke`: the tiny random model, 2 repeats (tests/bench/).
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


def serve(path: Path) -> tuple[str, object]:
    """Base URL and state of a service on a free port serving `path` as 'm'."""
    import uvicorn

    from posttrain.common.net import listen_socket
    from posttrain.service.app import create_app

    app = create_app(TOKEN, scratch(), {"m": path})
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
        args.repeats, args.batch, args.length = 2, 4, 16
    url, state = serve(path)
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
    times: dict[str, list[float]] = {"SDK round trip": [], "in process": []}
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
    print(header())
    print(f"# model {path.name}, LoRA r{args.rank}, batch {args.batch} x {args.length} tokens")
    base = statistics.median(times["in process"][1:])
    print("| path | s/step (median) | vs in process |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        print(f"| {name} | {med:.3f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
