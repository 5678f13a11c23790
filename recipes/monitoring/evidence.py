"""Evidence for the reward-hacking monitors (hacking.py) and the guard
`monitor.on_hacking`.

After each step the loop calls `watch`: the monitors run over the metrics so far; each
firing goes into the step's advisories ("hacking_heldout: ..."), so the console prints
it once, when it starts (advisories.py), and `posttrain status` and the dashboard list
it with its step range. A firing that starts at this step also gets one line
in `RUN_DIR/hacking.jsonl`: its steps, trajectory and 3–5 sample rollouts chosen from the
step's saved rollouts (`select_samples`: prompt, response, reward and its breakdown).
Then `guard` applies `monitor.on_hacking` (warn, checkpoint or stop).

Cost: the monitors are a few passes over the metrics rows (milliseconds for thousands
of steps); the rollouts file is read only at a firing's first step.

Limits: samples come from the training rollouts of the step the firing started at
(`monitor.save_rollouts: false` leaves none: the line says so); the held-out
evaluation's own samples are in `RUN_DIR/eval/`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ...config import HackingConfig
from .advisories import advisory_ranges, code_of
from .hacking import Firing, monitors
from .log import HACKING_FILE, read_jsonl
from .signatures import repetition, signatures

SAMPLES = 4
_TEXT = 600  # characters of a prompt / response kept in the evidence


def _components(details: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in details.items()
        if "." not in k and isinstance(v, int | float) and not isinstance(v, bool)
    }


def _score(row: dict[str, Any], pick: str, many: int) -> float:
    """How well a rollout-file row shows a firing of kind `pick` (higher: better)."""
    details = row.get("reward_details") or {}
    if pick == "length":
        return float(len(row.get("response_ids", [])))
    if pick == "repetition":
        return repetition(row.get("response_ids", []))
    if pick.startswith("component:"):
        comps = _components(details)
        name = pick.split(":", 1)[1]
        others = [v for k, v in comps.items() if k != name]
        return comps.get(name, 0.0) - (sum(others) / len(others) if others else 0.0)
    if pick.startswith("strict:"):  # paid by the reward, failed by the stricter component
        return float(row["reward"]) - _components(details).get(pick.split(":", 1)[1], 0.0)
    if pick.startswith("signature:"):
        found = signatures(row.get("response_text", ""), details, many)
        return float(pick.split(":", 1)[1] in found)
    return float(row["reward"])


def select_samples(
    rows: Sequence[dict[str, Any]], pick: str, k: int = SAMPLES, many: int = 4
) -> list[dict[str, Any]]:
    """Up to `k` rollouts (rows of a rollouts/step_*.jsonl file) that best show a firing
    of kind `pick` (Firing.pick), best first, one per prompt group before a second from
    any; ties go to the higher reward. Rows that could not be scored are left out.

    Returns:
        [{"uid", "prompt", "response", "reward", "breakdown"}]: texts cut to 600
        characters (the prompt's end, the response's start); `breakdown` the reward's
        details (components and verifier notes; long strings cut to 200 characters).
    """
    ok = [r for r in rows if isinstance(r.get("reward"), int | float)]
    ranked = sorted(ok, key=lambda r: (-_score(r, pick, many), -float(r["reward"])))
    seen: set[str] = set()
    first = []
    for r in ranked:
        if r.get("group_id") not in seen:
            seen.add(r.get("group_id", ""))
            first.append(r)
    chosen = (first + [r for r in ranked if r not in first])[:k]
    return [
        {
            "uid": r.get("uid"),
            "prompt": r.get("prompt_text", "")[-_TEXT:],
            "response": r.get("response_text", "")[:_TEXT],
            "reward": r["reward"],
            "breakdown": {
                key: v[:200] if isinstance(v, str) else v
                for key, v in (r.get("reward_details") or {}).items()
            },
        }
        for r in chosen
    ]


def record(run_dir: Path, step: int, started: Sequence[Firing], many: int) -> None:
    """Append one line per firing in `started` to RUN_DIR/hacking.jsonl: the firing,
    the step it started at and samples from that step's rollouts file (its evaluation
    file, RUN_DIR/eval/, when the step has none: the final evaluation's row)."""
    if not started:
        return
    name = f"step_{step:05d}.jsonl"
    # the final evaluation's row has no training rollouts: its held-out samples then
    rows = read_jsonl(Path(run_dir) / "rollouts" / name) or read_jsonl(
        Path(run_dir) / "eval" / name
    )
    with open(Path(run_dir) / HACKING_FILE, "a") as f:
        for firing in started:
            samples = select_samples(rows, firing.pick, SAMPLES, many)
            line = {"step": step, **firing.to_dict(), "samples": samples}
            if not rows:
                line["note"] = "no saved rollouts for this step (monitor.save_rollouts)"
            f.write(json.dumps(line) + "\n")


def watch(
    history: Sequence[dict[str, Any]], metrics: dict[str, Any], t: HackingConfig, run_dir: Path
) -> tuple[list[Firing], list[Firing]]:
    """The monitors over `history` + this step's `metrics`, and the evidence of those
    that start here (not raised at the step before) written to hacking.jsonl.

    Returns:
        (every firing of this step, the ones that started at it).
    """
    firings = monitors([*history, metrics], t)
    before = history[-1].get("advisories") if history else None
    was = {code_of(a) for a in before} if isinstance(before, list) else set()
    started = [
        f for f in firings if f.code not in was or history[-1]["step"] != metrics["step"] - 1
    ]
    record(run_dir, int(metrics["step"]), started, t.many_answers)
    return firings, started


def read_evidence(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of RUN_DIR/hacking.jsonl (none when absent)."""
    return read_jsonl(Path(run_dir) / HACKING_FILE)


def evidence_for(evidence: Sequence[dict[str, Any]], code: str, first: int, last: int) -> dict:
    """The evidence line of the firing `code` that started within steps first..last
    (the newest such); {} when there is none."""
    lines = [e for e in evidence if e.get("code") == code and first <= e.get("step", -1) <= last]
    return lines[-1] if lines else {}


def hacking_ranges(rows: Sequence[dict[str, Any]], run_dir: Path) -> list[dict[str, Any]]:
    """The reward-hacking firings of metrics.jsonl `rows` as advisory ranges
    (advisories.py `advisory_ranges`), each with its evidence from hacking.jsonl:
    `trajectory`, `samples` (select_samples) and `evidence_step` (the step the samples
    are from); empty lists when the evidence is missing. For `posttrain status` and the
    dashboard's /api/hacking."""
    evidence = read_evidence(run_dir)
    out = []
    for r in advisory_ranges(rows):
        if r.code.startswith("hacking_"):
            e = evidence_for(evidence, r.code, r.first, r.last)
            out.append(
                r.to_dict()
                | {
                    "trajectory": e.get("trajectory", []),
                    "samples": e.get("samples", []),
                    "evidence_step": e.get("step"),
                }
            )
    return out


def evidence_lines(firing: dict[str, Any], width: int = 160) -> list[str]:
    """A `hacking_ranges` entry as console lines: the trajectory (up to 12 points),
    then one line per sample (reward, its components, the response's start)."""
    points = firing.get("trajectory", [])[-12:]
    lines = []
    if points:
        keys = [k for k in points[0] if k != "step"]
        cells = "; ".join(f"{p['step']}: " + " ".join(f"{p.get(k)}" for k in keys) for p in points)
        lines.append(f"trajectory (step: {' '.join(keys)}): {cells}"[:width])
    for s in firing.get("samples", []):
        comps = " ".join(f"{k}={v}" for k, v in _components(s.get("breakdown", {})).items())
        text = " ".join(str(s.get("response", "")).split())
        lines.append(f"sample {s.get('uid')} reward {s.get('reward')} ({comps}): {text!r}"[:width])
    if not firing.get("samples") and firing.get("evidence_step") is None:
        lines.append("no evidence recorded (hacking.jsonl)")
    return lines


class HackingStopped(RuntimeError):
    """`monitor.on_hacking: stop`: a reward-hacking monitor fired; the run stopped after
    a checkpoint. The message names the firings, the evidence and how to resume."""


def guard(
    mode: str, started: Sequence[Firing], done: int, run_dir: Path, save: Callable[[], Path]
) -> Path | None:
    """Apply `monitor.on_hacking` after a step (`done` steps done, due checkpoints
    written) at which the firings `started` started.

    warn: nothing. checkpoint: call `save` (a checkpoint after `done` steps) unless one
    exists. stop: the same, then raise.

    Returns:
        The checkpoint folder written, or None.

    Raises:
        HackingStopped: mode stop and at least one firing started.
        ValueError: an unknown mode.
    """
    if mode not in ("warn", "checkpoint", "stop"):
        raise ValueError(f"monitor.on_hacking must be warn, checkpoint or stop, not {mode!r}")
    if mode == "warn" or not started:
        return None
    folder = Path(run_dir) / "checkpoints" / f"step_{done:05d}"
    written = None if (folder / "trainer_state.json").is_file() else save()
    if written is not None:
        tqdm.write(f"checkpoint: {written} (monitor.on_hacking: {mode})")
    if mode == "stop":
        codes = ", ".join(f.code for f in started)
        raise HackingStopped(
            f"step {done - 1}: {codes} fired (monitor.on_hacking: stop); evidence in "
            f"{Path(run_dir) / HACKING_FILE} and `posttrain status {run_dir}`. Checkpoint "
            f"{folder}; to go on anyway, resume with: posttrain run --resume {run_dir} "
            "--set monitor.on_hacking=warn"
        )
    return written
