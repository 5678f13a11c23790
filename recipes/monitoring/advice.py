"""Advice from a run's own measurements (`posttrain status RUN_DIR --advise`, the
dashboard's "Advice" card): the rollout:learner split with the shortest step, and the
checkpoint interval for a given MTBF. No torch here.

The split: per step, the spans give the generate phase G (first rollout `generate`
start to last end), the train phase T (learner forward/backward/optimizer) and the push
P (`weight_sync`); the rest of the step O (scoring, the controller) stays as measured.
With R engines and L learner ranks of the same D devices, the synchronous step is
predicted as G·R/r + T·L/l + P + O for r engines and l = D − r ranks: each side's work
divides evenly over its devices (data-parallel engines, FSDP ranks), to first order
(Amdahl per side; no fixed per-worker cost).

The checkpoint interval: Young/Daly, sqrt(2·C·MTBF) (recipes/planning/formulas.py), with C the mean
measured save time of the run's checkpoints (`seconds` in their trainer_state.json).

Limits: means over the measured steps after the first (warm-up) when there are more
than one; on `resources.device: cpu` every worker shares the machine's cores, so moving
a worker moves no hardware and the split estimate does not hold there.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..planning.formulas import young_daly_interval

TRAIN_KINDS = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class Phases:
    """Mean measured seconds per step: generate G, train T, push P, the whole step, over
    `steps` steps, with `engines` rollout engines and `learners` learner ranks."""

    generate: float
    train: float
    push: float
    step: float
    steps: int
    engines: int
    learners: int

    @property
    def other(self) -> float:
        """Seconds of the step in no phase (scoring, controller), kept as measured."""
        return max(0.0, self.step - self.generate - self.train - self.push)

    def predicted_step(self, engines: int, learners: int) -> float:
        """The step with `engines` engines and `learners` ranks (module docstring)."""
        return (
            self.generate * self.engines / engines
            + self.train * self.learners / learners
            + self.push
            + self.other
        )


@dataclass(frozen=True)
class Split:
    """A rollout:learner split in devices and its predicted step, seconds."""

    rollout: int
    learner: int
    step: float


def _extent(spans: list[dict[str, Any]]) -> float:
    return max(s["end"] for s in spans) - min(s["start"] for s in spans) if spans else 0.0


def measured_phases(
    rows: list[dict[str, Any]], spans: list[dict[str, Any]], engines: int, learners: int
) -> Phases | None:
    """Mean phases of the steps that logged `time/step` (the first left out when there
    are more); None when no step was measured."""
    timed = {r["step"]: r["time/step"] for r in rows if r.get("time/step") is not None}
    steps = sorted(timed)[1:] if len(timed) > 1 else sorted(timed)
    if not steps:
        return None
    by_step: dict[int, list[dict[str, Any]]] = {}
    for s in spans:
        by_step.setdefault(s["step"], []).append(s)

    def mean(pick: Any) -> float:
        return statistics.fmean(_extent([s for s in by_step.get(k, []) if pick(s)]) for k in steps)

    return Phases(
        generate=mean(lambda s: s["role"] == "rollout" and s["kind"] == "generate"),
        train=mean(lambda s: s["role"] == "learner" and s["kind"] in TRAIN_KINDS),
        push=mean(lambda s: s["kind"] == "weight_sync"),
        step=statistics.fmean(timed[k] for k in steps),
        steps=len(steps),
        engines=engines,
        learners=learners,
    )


def best_split(p: Phases, devices: int, per_engine: int = 1) -> Split:
    """The split of `devices` (engines of `per_engine` devices, at least one each side)
    with the shortest predicted step; ties keep the fewer rollout devices."""
    options = [
        Split(r, devices - r, p.predicted_step(r // per_engine, devices - r))
        for r in range(per_engine, devices, per_engine)
    ]
    return min(options, key=lambda s: (s.step, s.rollout))


def checkpoint_seconds(run_dir: Path) -> list[float]:
    """Measured save times of the run's complete checkpoints, seconds (those written
    before this was recorded have none)."""
    out = []
    for f in sorted(Path(run_dir).glob("checkpoints/step_*/trainer_state.json")):
        try:
            v = json.loads(f.read_text()).get("seconds")
        except (OSError, ValueError):
            continue
        if isinstance(v, int | float):
            out.append(float(v))
    return out


@dataclass(frozen=True)
class Advice:
    """What `--advise` prints; `lines` are the sentences, the rest their numbers."""

    phases: Phases | None
    current: Split | None
    best: Split | None
    checkpoint_s: float | None
    interval_s: float | None
    interval_steps: int | None
    lines: list[str]


def advise(
    run_dir: Path,
    rows: list[dict[str, Any]],
    spans: list[dict[str, Any]],
    rollout_gpus: int,
    per_engine: int,
    learner_gpus: int,
    device: str,
    mtbf_hours: float | None,
) -> Advice:
    """The split and checkpoint advice of a run (module docstring).

    Args:
        rows, spans: the run's metrics.jsonl and spans.jsonl rows.
        rollout_gpus, per_engine, learner_gpus, device: the run's `resources`.
        mtbf_hours: mean time between failures of the cluster, hours (> 0); None: the
            checkpoint line gives the measured cost only.

    Raises:
        ValueError: mtbf_hours <= 0.
    """
    if mtbf_hours is not None and mtbf_hours <= 0:
        raise ValueError(f"--mtbf must be > 0 hours, got {mtbf_hours}")
    lines: list[str] = []
    engines = rollout_gpus // per_engine
    p = measured_phases(rows, spans, engines, learner_gpus)
    p, current, best = _split_advice(p, rollout_gpus, per_engine, learner_gpus, device, lines)
    step_s = p.step if p else None
    c, interval, steps = _checkpoint_advice(run_dir, mtbf_hours, step_s, lines)
    return Advice(p, current, best, c, interval, steps, lines)


def _split_advice(
    p: Phases | None,
    rollout_gpus: int,
    per_engine: int,
    learner_gpus: int,
    device: str,
    lines: list[str],
) -> tuple[Phases | None, Split | None, Split | None]:
    """Append the measured phases and the split advice to `lines`.

    Returns:
        `(phases, current, best)`: phases None when there is no step or no generate
        span (then no split either).
    """
    engines = rollout_gpus // per_engine
    current = best = None
    if p is None:
        lines.append("split: no step measured yet (metrics.jsonl has no time/step)")
    elif p.generate == 0:
        p = None
        lines.append("split: no rollout generate spans (DPO has no rollout side)")
    else:
        current = Split(rollout_gpus, learner_gpus, p.predicted_step(engines, learner_gpus))
        best = best_split(p, rollout_gpus + learner_gpus, per_engine)
        lines.append(
            f"measured (mean of {p.steps} steps): generate {p.generate:.2f} s with "
            f"{engines} engine(s), train {p.train:.2f} s with {learner_gpus} "
            f"rank(s), push {p.push:.2f} s, other {p.other:.2f} s; step {p.step:.2f} s"
        )
        if (best.rollout, best.learner) == (rollout_gpus, learner_gpus):
            lines.append(
                f"split: keep {rollout_gpus}:{learner_gpus}; no other split of "
                f"{rollout_gpus + learner_gpus} devices is predicted faster"
            )
        else:
            lines.append(
                f"split: resources.rollout.gpus: {best.rollout}, "
                f"resources.learner.gpus: {best.learner}: step {p.step:.2f} s -> "
                f"{best.step:.2f} s predicted ({p.step / best.step:.2f}x, "
                f"{1 - best.step / p.step:.0%} shorter)"
            )
        if device == "cpu":
            lines.append(
                "note: resources.device cpu: all workers share this machine's "
                "cores, so the split estimate (one device per worker) does not "
                "hold here"
            )
    return p, current, best


def _checkpoint_advice(
    run_dir: Path, mtbf_hours: float | None, step_s: float | None, lines: list[str]
) -> tuple[float | None, float | None, int | None]:
    """Append the checkpoint advice to `lines`: the mean measured save and, with an
    MTBF, the Young/Daly interval (in steps when the step time `step_s` is known).

    Returns:
        `(mean save seconds, interval seconds, interval steps)`, each None when unknown.
    """
    costs = checkpoint_seconds(run_dir)
    c = statistics.fmean(costs) if costs else None
    interval = steps = None
    if c is None:
        lines.append(
            "checkpoint: no measured checkpoint in this run (train.checkpoint_every "
            "writes them; the last step writes one)"
        )
    elif mtbf_hours is None:
        lines.append(
            f"checkpoint: a save took {c:.1f} s (mean of {len(costs)}); give --mtbf "
            "HOURS (the cluster's mean time between failures) for the interval"
        )
    else:
        interval = young_daly_interval(c, mtbf_hours * 3600)
        steps = max(1, round(interval / step_s)) if step_s else None
        every = f"; set train.checkpoint_every: {steps}" if steps else ""
        lines.append(
            f"checkpoint: a save took {c:.1f} s (mean of {len(costs)}); with an MTBF "
            f"of {mtbf_hours:g} h, Young/Daly sqrt(2·C·MTBF) = {interval:.0f} s"
            f"{f' = {steps} steps of {step_s:.1f} s' if steps else ''}{every}"
        )
    return c, interval, steps


def advise_run(run_dir: Path, rows: list[dict[str, Any]], mtbf_hours: float | None) -> Advice:
    """`advise` with the run folder's own spans.jsonl and recipe.yaml (its resources)."""
    from ...config import RecipeError
    from ..loading import load_recipe
    from .log import SPANS_FILE, read_jsonl

    try:
        res = load_recipe(Path(run_dir) / "recipe.yaml").resources
    except RecipeError as e:
        return Advice(None, None, None, None, None, None, [f"advice: {e}"])
    return advise(
        run_dir,
        rows,
        read_jsonl(Path(run_dir) / SPANS_FILE),
        res.rollout.gpus,
        res.rollout.gpus_per_engine,
        res.learner.gpus,
        res.device,
        mtbf_hours,
    )
