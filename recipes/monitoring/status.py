"""`posttrain status RUN_DIR`: a table of a run's last steps (the columns its algorithm
logs), the means over its training steps, its advisories, one line per run of
consecutive steps, and the reward-hacking firings' evidence (trajectory and samples).
Reads `metrics.jsonl` and `hacking.jsonl` rows only; no torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .advisories import advisory_ranges
from .evidence import evidence_lines, hacking_ranges
from .log import HACKING_FILE

#: (header, metric, format) of a pair algorithm's steps (DPO, reward model).
PAIR_COLUMNS = [
    ("step", "step", "{:.0f}"),
    ("loss", "loss", "{:.4f}"),
    ("pref acc", "rewards/accuracy", "{:.3f}"),
    ("margin", "rewards/margin", "{:.4f}"),
    ("chosen r", "rewards/chosen", "{:.4f}"),
    ("rejected r", "rewards/rejected", "{:.4f}"),
    ("step s", "time/step", "{:.1f}"),
    ("ref s", "time/reference", "{:.1f}"),
    ("train s", "time/train", "{:.1f}"),
    ("learner idle", "learner_idle_fraction", "{:.2f}"),
]

#: (header, metric, format) of a rollout algorithm's steps (GRPO, PPO).
ROLLOUT_COLUMNS = [
    ("step", "step", "{:.0f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("acc", "accuracy", "{:.3f}"),
    ("len", "response_length_mean", "{:.1f}"),
    ("step s", "time/step", "{:.1f}"),
    ("gen s", "time/generate", "{:.1f}"),
    ("score s", "time/score", "{:.2f}"),
    ("logp s", "time/logprobs", "{:.1f}"),
    ("train s", "time/train", "{:.1f}"),
    ("sync s", "time/weight_sync", "{:.2f}"),
    ("rollout idle", "rollout_idle_fraction", "{:.2f}"),
    ("learner idle", "learner_idle_fraction", "{:.2f}"),
]

Column = tuple[str, str, str]


def columns(rows: list[dict[str, Any]]) -> tuple[list[Column], list[Column]]:
    """The table's columns for these rows, and which of them are evaluations (whose
    values are of different policies, so they get no mean)."""
    dpo = bool(rows) and "rewards/accuracy" in rows[0]
    cols = list(PAIR_COLUMNS if dpo else ROLLOUT_COLUMNS)
    if any("staleness_mean" in r for r in rows):  # asynchronous: generation runs behind
        cols = [("gen wait s", k, f) if k == "time/generate" else (n, k, f) for n, k, f in cols]
        cols.append(("stale", "staleness_mean", "{:.2f}"))
    evals = (
        [("eval p@1", "eval/pass@1", "{:.3f}"), ("eval p@k", "eval/pass@k", "{:.3f}")]
        if any("eval/pass@k" in r for r in rows)
        else []
    )
    if any("eval/accuracy" in r for r in rows):  # a reward model's held-out pairs
        evals += [("eval acc", "eval/accuracy", "{:.3f}"), ("eval loss", "eval/loss", "{:.4f}")]
    return cols + evals, evals


def _cell(row: dict[str, Any], key: str, f: str) -> str:
    v = row.get(key)
    return "–" if v is None else f.format(v)


def last_steps(rows: list[dict[str, Any]], last: int) -> list[dict[str, Any]]:
    """The rows from the `last`-th training step from the end on: those steps, and the
    rows of evaluations among and after them (the final policy's has a row of its own)."""
    steps = [i for i, r in enumerate(rows) if not _evaluation_only(r)]
    if len(steps) <= last:
        return rows
    return rows[steps[-last] :]


def _evaluation_only(row: dict[str, Any]) -> bool:
    """A row with nothing but an evaluation's keys (`eval/...`, `time/eval`, its step)."""
    return all(k == "step" or k.startswith("eval/") or k == "time/eval" for k in row)


def status_table(run_dir: Path, rows: list[dict[str, Any]], last: int) -> Table:
    """The last `last` training steps (`last_steps`) and, below them, the mean of every
    training step."""
    cols, evals = columns(rows)
    # an evaluation of the final policy adds a row of its own, not a training step
    trained = [r for r in rows if "time/step" in r]
    table = Table(title=f"{run_dir.name}: {len(trained)} steps")
    for name, _, _ in cols:
        table.add_column(name, justify="right")
    for row in last_steps(rows, last):
        table.add_row(*[_cell(row, k, f) for _, k, f in cols])
    if trained:
        # over every training step; evaluations are of different policies: no mean
        skip = {k for _, k, _ in evals}
        present = {
            k: [r[k] for r in trained if r.get(k) is not None] for _, k, _ in cols if k not in skip
        }
        mean = {k: sum(v) / len(v) if v else None for k, v in present.items()}
        table.add_section()
        table.add_row(f"mean of {len(trained)}", *[_cell(mean, k, f) for _, k, f in cols[1:]])
    return table


def print_status(run_dir: Path, rows: list[dict[str, Any]], last: int) -> None:
    """The table, then each advisory that touches the shown steps, once per run of
    consecutive steps with the last step's numbers."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(status_table(run_dir, rows, last))
    shown = [r["step"] for r in last_steps(rows, last) if "step" in r]
    advised = [
        r for r in advisory_ranges(rows) if shown and r.last >= shown[0] and r.first <= shown[-1]
    ]
    if advised:
        console.print("advisories (monitor.advisories sets the thresholds):")
        for r in advised:
            console.print(f"  {r.steps}: {r.message}", markup=False)
    firings = [
        f
        for f in hacking_ranges(rows, run_dir)
        if shown and f["last"] >= shown[0] and f["first"] <= shown[-1]
    ]
    if firings:
        console.print(
            "reward-hacking evidence (monitor.hacking sets the thresholds; "
            f"{run_dir / HACKING_FILE}):"
        )
        for f in firings:
            console.print(f"  {f['steps']}: {f['code']}", markup=False)
            for line in evidence_lines(f, 150):
                console.print(f"    {line}", markup=False)
