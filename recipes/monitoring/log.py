"""Where each step's numbers go: `metrics.jsonl` and `spans.jsonl` in the run folder
(the source of truth, read by the dashboard and `posttrain status`), TensorBoard event
files in `RUN_DIR/tensorboard`, and Weights & Biases when the recipe names a project.

Written from the controller's thread once per step, after the weight push; a crash
loses at most the step in flight.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ...common.telemetry import Span
from ...config import Recipe

METRICS_FILE, SPANS_FILE = "metrics.jsonl", "spans.jsonl"
HACKING_FILE = "hacking.jsonl"  # the reward-hacking monitors' evidence (evidence.py)


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    # NaN (e.g. nothing scored) is not JSON: write null.
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()}


class StepLog:
    """Appends one step at a time to every configured sink."""

    def __init__(self, run_dir: Path, recipe: Recipe):
        """Appends to what is there and deletes nothing: a resume calls `rewind(step)`
        once its checkpoint has loaded, so each step appears once and a resume that
        fails keeps every line."""
        self.run_dir = run_dir
        self.tb = self.wandb = None
        if recipe.monitor.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if recipe.monitor.wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError(
                    "monitor.wandb_project is set but wandb is not installed; "
                    "pip install wandb, or remove monitor.wandb_project"
                ) from e
            self.wandb = wandb.init(
                project=recipe.monitor.wandb_project,
                name=recipe.name,
                dir=str(run_dir),
                config=recipe.model_dump(mode="json"),
            )

    def _drop_from(self, start: int) -> None:
        for name in (METRICS_FILE, SPANS_FILE, HACKING_FILE):
            rows = [r for r in read_jsonl(self.run_dir / name) if r.get("step", -1) < start]
            (self.run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        for f in (self.run_dir / "rollouts").glob("step_*.jsonl"):
            if int(f.name[5:-6]) >= start:
                f.unlink()

    def rewind(self, step: int) -> None:
        """Drop what was logged for steps from `step` on from metrics.jsonl, spans.jsonl,
        hacking.jsonl and rollouts/ (a resume, or a learner restart, went back to a
        checkpoint and runs them again); TensorBoard purges them on its next event
        (`purge_step`)."""
        self._drop_from(step)
        if self.tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=step)

    def record(self, step: int, metrics: dict[str, Any], spans: list[Span]) -> None:
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(_clean(metrics)) + "\n")
        with open(self.run_dir / SPANS_FILE, "a") as f:
            for s in spans:
                f.write(json.dumps(s.to_dict()) + "\n")
        numeric = {
            k: v
            for k, v in metrics.items()
            if isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v))
        }
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, global_step=step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a jsonl file; a half-written last line (run in progress) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
