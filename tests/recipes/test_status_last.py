"""`posttrain status --last N` shows N training steps; the final policy's evaluation row
comes with them instead of taking one of their places."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from posttrain.recipes.monitoring.status import last_steps, status_table


def _rows() -> list[dict]:
    rows: list[dict] = [{"step": s, "reward_mean": 0.1 * s, "time/step": 5.0} for s in range(5)]
    rows[2]["eval/pass@1"] = 0.3  # an evaluation on a training step: one row
    rows[2]["eval/pass@k"] = 0.5
    rows.append({"step": 5, "eval/pass@1": 0.5, "eval/pass@k": 0.7})  # the final policy's
    return rows


def test_last_counts_training_steps() -> None:
    rows = _rows()
    assert [r["step"] for r in last_steps(rows, 3)] == [2, 3, 4, 5]
    assert [r["step"] for r in last_steps(rows, 1)] == [4, 5]
    assert last_steps(rows, 5) == rows
    assert last_steps(rows, 50) == rows


def test_table_shows_them(tmp_path: Path) -> None:
    console = Console(width=200, record=True)
    console.print(status_table(tmp_path, _rows(), 3))
    body = console.export_text().splitlines()
    first = [line.split("│")[1].strip() for line in body if line.startswith("│")]
    assert first == ["2", "3", "4", "5", "mean of 5"]


def test_rows_without_timings_count_as_steps() -> None:
    # only an evaluation's own keys make a row an evaluation (a test's or an old run's
    # training rows may lack time/step)
    rows = [{"step": s, "reward_mean": 0.1} for s in range(4)]
    rows.append({"step": 4, "eval/pass@1": 0.5, "time/eval": 60.0})
    assert [r["step"] for r in last_steps(rows, 2)] == [2, 3, 4]
