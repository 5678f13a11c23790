"""The console summary `posttrain run` prints at the end of a run: steps, wall time, the
loss or reward trend, the median step and the medians of its parts, and where the metrics
and final policy are."""

from __future__ import annotations

import statistics
from pathlib import Path

import typer


def print_summary(history: list[dict[str, float]], run_dir: Path, wall: float) -> None:
    if not history:
        return
    if "sft/assistant_tokens" in history[0]:  # SFT: no rollout timings or rewards
        evals = [h["eval/loss"] for h in history if "eval/loss" in h]
        held = f"   held-out loss {evals[-1]:.4f}" if evals else ""
        typer.echo(
            f"done: {len(history)} steps in {wall:.0f} s\n"
            f"  loss {history[0]['loss']:.4f} → {history[-1]['loss']:.4f}{held}\n"
            f"  metrics: {run_dir / 'metrics.jsonl'}   final policy: {run_dir / 'final'}"
        )
        return
    if "rewards/accuracy" in history[0]:  # DPO
        first, last = history[0], history[-1]
        typer.echo(
            f"done: {len(history)} steps in {wall:.0f} s\n"
            f"  loss {first['loss']:.4f} → {last['loss']:.4f}   reward accuracy "
            f"{first['rewards/accuracy']:.2f} → {last['rewards/accuracy']:.2f}   margin "
            f"{first['rewards/margin']:.3f} → {last['rewards/margin']:.3f}\n"
            f"  metrics: {run_dir / 'metrics.jsonl'}   final policy: {run_dir / 'final'}"
        )
        return
    first, last = history[: min(3, len(history))], history[-min(3, len(history)) :]

    def mean(rows: list[dict[str, float]], key: str) -> float:
        return sum(h[key] for h in rows) / len(rows)

    def median(key: str) -> float:  # the first step's warm-up does not move it
        return statistics.median(h[key] for h in history)

    keys = ["generate", "score", "logprobs", "train", "weight_sync"]
    split = "  ".join(f"{k} {median('time/' + k):.1f}s" for k in keys)
    typer.echo(
        f"done: {len(history)} steps in {wall:.0f} s\n"
        f"  reward mean, first {len(first)} steps: {mean(first, 'reward_mean'):.3f}   "
        f"last {len(last)}: {mean(last, 'reward_mean'):.3f}\n"
        f"  median step {median('time/step'):.1f}s; medians of its parts: {split}\n"
        f"  idle fraction (mean): rollout {mean(history, 'rollout_idle_fraction'):.2f}  "
        f"learner {mean(history, 'learner_idle_fraction'):.2f}\n"
        f"  metrics: {run_dir / 'metrics.jsonl'}   final policy: {run_dir / 'final'}"
    )
