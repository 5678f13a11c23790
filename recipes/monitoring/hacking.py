"""Reward-hacking monitors: pure functions over a run's per-step metrics (the rows of
metrics.jsonl, oldest first) and `monitor.hacking`, each returning a `Firing` with its
evidence (the steps and the metric's trajectory) or None. No torch, no I/O: they run
after every step over numbers the step already computed.

Codes, and when each fires (HackingConfig keys):

- `hacking_heldout`: train `reward_mean` rose between the first and the last held-out
  measurement (`heldout_metric`) by ≥ `reward_rise` and by ≥ `rise_z` standard errors,
  while that metric rose less than `heldout_share` × the reward's rise (or fell).
- `hacking_component`: one `reward/NAME` rose by ≥ `component_rise` and ≥ `rise_z`
  standard errors while every other rose less than `component_share` × that (or fell).
- `hacking_length`, `hacking_repetition`, `hacking_entropy`: `response_length_mean` ≥
  `length_ratio` × its baseline; `repetition` rose ≥ `repetition_rise`; `entropy` fell
  to 1/`entropy_ratio` of its baseline or rose to `entropy_ratio` × it.
- `hacking_early_exit`, `hacking_patched`, `hacking_many_answers`, `hacking_hedged`: the
  mean of `hack/NAME` (signatures.py) over the last `window` steps ≥ `bypass_share`.
- `hacking_kl`, `hacking_mismatch`: the step's `kl` (`logprob_mismatch`) ≥ `jump_ratio`
  × the median of the `window` steps before it and ≥ `kl_floor` (`mismatch_floor`).

A rise, in (1) and (2), is that of a least-squares line fitted to the per-step values
over the span (`fitted_rise`): its slope × the span, with the slope's standard error from
the residuals, so the steps' own scatter (which prompts a step drew, sampling) sets the
noise a rise must clear; it needs 2 × `window` steps. (3)'s baseline is the mean of the
first `window` steps that logged the metric, its "now" the mean of the last `window`.

Limits: these see aggregates. A trend that is the task itself (a recipe that rewards
longer answers) fires as hacking does: raise that monitor's key in the recipe. A held-out
metric measured by the same gameable verifier cannot see the gaming; give a stricter
one (`heldout_metric`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...config import HackingConfig

Rows = Sequence[dict[str, Any]]
_ROLLOUT_KEYS = {"reward_mean", "response_length_mean"}  # logged by every rollout step


@dataclass(frozen=True)
class Firing:
    """One monitor's finding at the last step of the history it saw.

    Attributes:
        code: `hacking_*` (module docstring's table).
        message: one line with the numbers and what to do.
        first, last: the steps the evidence spans (inclusive).
        trajectory: the metric(s) over those steps, [{"step": s, KEY: value, ...}].
        pick: how to choose sample rollouts that show it (evidence.py `select_samples`):
            "reward", "strict:NAME" (rewarded, but component NAME scored them low),
            "component:NAME", "length", "repetition" or "signature:NAME".
    """

    code: str
    message: str
    first: int
    last: int
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    pick: str = "reward"

    @property
    def advisory(self) -> str:
        """The "code: message" advisory string of metrics.jsonl."""
        return f"{self.code}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "first": self.first,
            "last": self.last,
            "trajectory": self.trajectory,
            "pick": self.pick,
        }


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def series(rows: Rows, key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged `key` as a finite number."""
    return [(int(r["step"]), float(r[key])) for r in rows if _num(r.get(key))]


def _mean(points: Sequence[tuple[int, float]]) -> float:
    return statistics.fmean(v for _, v in points)


def _trend(rows: Rows, key: str, w: int) -> tuple[list[tuple[int, float]], float, float] | None:
    """The series of `key`, its baseline (first `w`) and now (last `w`) means; None
    with fewer than 2w points."""
    s = series(rows, key)
    if len(s) < 2 * w:
        return None
    return s, _mean(s[:w]), _mean(s[-w:])


def _traj(points: Sequence[tuple[int, float]], key: str) -> list[dict[str, Any]]:
    return [{"step": s, key: round(v, 6)} for s, v in points]


@dataclass(frozen=True)
class Rise:
    """A least-squares line through (step, value) points over steps first..last.

    Attributes:
        first, last: the steps the line spans.
        start, end: the line's values at `first` and `last` (the metric's units).
        se: the standard error of `end - start` (inf for two points: no scatter to
            measure; 0 for an exact line).
    """

    first: int
    last: int
    start: float
    end: float
    se: float

    @property
    def rise(self) -> float:
        return self.end - self.start

    @property
    def z(self) -> float:
        """The rise in standard errors (inf for an exact line that rose)."""
        if self.se > 1e-9 * abs(self.rise):  # below: the rounding of an exact line
            return self.rise / self.se
        return math.inf if self.rise > 0 else 0.0

    @property
    def z_text(self) -> str:
        return f"{self.z:.1f} standard errors" if self.z < 100 else "≥ 100 standard errors"


def fitted_rise(points: Sequence[tuple[int, float]], first: int, last: int) -> Rise | None:
    """The rise of the ordinary least-squares line through `points` between steps
    `first` and `last`: slope b = Sxy/Sxx, se(b) = sqrt(SSR / (n - 2) / Sxx), rise
    b·(last - first) with standard error se(b)·(last - first) (the textbook simple
    regression, e.g. Wasserman, All of Statistics, §13.1). None for fewer than two points
    or one step."""
    n = len(points)
    if n < 2 or last <= first:
        return None
    mx, my = statistics.fmean(x for x, _ in points), _mean(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    ssr = sum((y - my - b * (x - mx)) ** 2 for x, y in points)
    se = math.sqrt(ssr / (n - 2) / sxx) if n > 2 else math.inf
    at = lambda x: my + b * (x - mx)  # noqa: E731
    return Rise(first, last, at(first), at(last), se * (last - first))


def _near(lo: int, hi: int, s: Sequence[tuple[int, float]]) -> float | None:
    got = [(k, v) for k, v in s if lo <= k <= hi]
    return _mean(got) if got else None


def heldout(rows: Rows, t: HackingConfig) -> Firing | None:
    """(1) The train reward rose while the held-out metric did not follow."""
    key, w = t.heldout_metric, t.window
    points = series(rows, key)
    if len(points) < 2:
        return None
    s0, s1 = points[0][0], points[-1][0]
    reward = [(k, v) for k, v in series(rows, "reward_mean") if s0 <= k <= s1]
    r, h = fitted_rise(reward, s0, s1), fitted_rise(points, s0, s1)
    if len(reward) < 2 * w or r is None or h is None:
        return None
    if r.rise < t.reward_rise or r.z < t.rise_z or h.rise >= t.heldout_share * r.rise:
        return None
    traj = []
    for s, v in points:
        m = _near(s - w + 1 if s > s0 else s0, s if s > s0 else s0 + w - 1, reward)
        traj.append(
            {"step": s, key: round(v, 6), "reward_mean": None if m is None else round(m, 6)}
        )
    return Firing(
        "hacking_heldout",
        f"train reward rose {r.start:.3f} → {r.end:.3f} (+{r.rise:.3f}, {r.z_text}; lines "
        f"fitted to steps {s0}–{s1}) while held-out {key} went {h.start:.3f} → "
        f"{h.end:.3f} ({h.rise:+.3f}; < {t.heldout_share:g} × the rise): "
        "the policy may be gaming the reward; read the samples (posttrain status RUN_DIR), "
        "tighten the verifier",
        s0,
        s1,
        traj,
        _strict_pick(key),
    )


def _strict_pick(key: str) -> str:
    """The samples to show for a held-out metric: those the reward paid but its named
    component scored low (`reward/NAME`, `eval/pass@1/NAME`), else the top-rewarded."""
    parts = key.split("/")
    if parts[0] == "reward" and len(parts) == 2:
        return f"strict:{parts[1]}"
    return f"strict:{parts[2]}" if parts[0] == "eval" and len(parts) == 3 else "reward"


def component(rows: Rows, t: HackingConfig) -> Firing | None:
    """(2) One reward component carries the gain while the others do not follow."""
    keys = sorted({k for r in rows for k in r if k.startswith("reward/") and _num(r[k])})
    pts = {k: s for k in keys if len(s := series(rows, k)) >= 2 * t.window}
    fits = {k: f for k, s in pts.items() if (f := fitted_rise(s, s[0][0], s[-1][0]))}
    if len(fits) < 2:
        return None
    for k, f in fits.items():
        others = {o: v for o, v in fits.items() if o != k}
        if f.rise < t.component_rise or f.z < t.rise_z:
            continue
        if all(v.rise < t.component_share * f.rise for v in others.values()):
            s = pts[k]
            flat = ", ".join(f"{o[7:]} {v.rise:+.3f}" for o, v in others.items())
            return Firing(
                "hacking_component",
                f"reward component {k[7:]} rose {f.rise:+.3f} ({f.z_text}; a "
                f"line fitted to steps {s[0][0]}–{s[-1][0]}) while the others did not ({flat}; "
                f"< {t.component_share:g} × that): the gain is {k[7:]} alone; check that its "
                "samples also solve the task",
                s[0][0],
                s[-1][0],
                [{"step": st, **{o: r.get(o) for o in fits}} for st, r in _by_step(rows, s)],
                f"component:{k[7:]}",
            )
    return None


def _by_step(rows: Rows, s: list[tuple[int, float]]) -> list[tuple[int, dict[str, Any]]]:
    wanted = {st for st, _ in s}
    return [(int(r["step"]), r) for r in rows if r.get("step") in wanted]


def drift(rows: Rows, t: HackingConfig) -> list[Firing]:
    """(3) Length, repetition or entropy drifted beyond its bound."""
    out, w = [], t.window
    if (tr := _trend(rows, "response_length_mean", w)) and tr[1] > 0:
        s, base, now = tr
        if now >= t.length_ratio * base:
            out.append(
                Firing(
                    "hacking_length",
                    f"mean response length grew {base:.1f} → {now:.1f} tokens ({now / base:.1f}×"
                    f", ≥ {t.length_ratio:g}×): check the samples for padding a length-blind "
                    "verifier rewards",
                    s[0][0],
                    s[-1][0],
                    _traj(s, "response_length_mean"),
                    "length",
                )
            )
    if (tr := _trend(rows, "repetition", w)) and tr[2] - tr[1] >= t.repetition_rise:
        s, base, now = tr
        out.append(
            Firing(
                "hacking_repetition",
                f"repeated 4-grams rose {base:.0%} → {now:.0%} of a response (+{now - base:.2f}"
                f", ≥ {t.repetition_rise:g}): the policy may loop text the reward counts",
                s[0][0],
                s[-1][0],
                _traj(s, "repetition"),
                "repetition",
            )
        )
    if (tr := _trend(rows, "entropy", w)) and tr[1] > 0:
        s, base, now = tr
        if now * t.entropy_ratio <= base or now >= t.entropy_ratio * base:
            out.append(
                Firing(
                    "hacking_entropy",
                    f"token entropy went {base:.3f} → {now:.3f} nats (beyond {t.entropy_ratio:g}×"
                    " either way): a collapse onto one answer pattern, or noise; read the samples",
                    s[0][0],
                    s[-1][0],
                    _traj(s, "entropy"),
                )
            )
    return out


def bypass(rows: Rows, t: HackingConfig) -> list[Firing]:
    """(4) Verifier-bypass signatures in at least `bypass_share` of recent samples."""
    out = []
    for name in ("early_exit", "patched", "many_answers", "hedged"):
        s = series(rows, f"hack/{name}")
        if len(s) < t.window or (now := _mean(s[-t.window :])) < t.bypass_share:
            continue
        shown = s[-2 * t.window :]
        out.append(
            Firing(
                f"hacking_{name}",
                f"{now:.0%} of the last {t.window} steps' samples show the {name} signature "
                f"(≥ {t.bypass_share:.0%}): read them; the verifier may be passing answers "
                "it should not",
                shown[0][0],
                shown[-1][0],
                _traj(shown, f"hack/{name}"),
                f"signature:{name}",
            )
        )
    return out


def jump(rows: Rows, t: HackingConfig) -> list[Firing]:
    """(5) The step's KL to the reference or logprob mismatch jumped."""
    out = []
    for key, floor, code in (
        ("kl", t.kl_floor, "hacking_kl"),
        ("logprob_mismatch", t.mismatch_floor, "hacking_mismatch"),
    ):
        s = series(rows, key)
        if len(s) <= t.window or s[-1][0] != rows[-1].get("step"):
            continue
        # the median of the `window` steps before: a steady drift moves it along, a jump not
        median, now = statistics.median(v for _, v in s[-t.window - 1 : -1]), s[-1][1]
        if now < floor or now < t.jump_ratio * median:
            continue
        shown = s[-(2 * t.window + 1) :]
        out.append(
            Firing(
                code,
                f"{key} jumped to {now:.4f} ({now / median:.1f}× the median {median:.4f} of "
                f"the {t.window} steps before; ≥ {t.jump_ratio:g}× and ≥ {floor:g})"
                if median > 0
                else f"{key} jumped to {now:.4f} from a median of 0 (≥ {floor:g})",
                shown[0][0],
                shown[-1][0],
                _traj(shown, key),
            )
        )
    return out


def monitors(rows: Rows, t: HackingConfig) -> list[Firing]:
    """Every monitor's firing at the last of `rows` (the metrics rows so far, ascending
    steps), in the table's order; [] for no rows, and [] for a run that samples no
    rollouts (no row has `reward_mean`, `response_length_mean` or `hack/*`: SFT, DPO,
    the reward model): there is no reward to game, and their own trends (entropy falls
    as SFT learns a format) are learning."""
    if not any(_ROLLOUT_KEYS & r.keys() or any(k[:5] == "hack/" for k in r) for r in rows):
        return []
    out = [f for f in (heldout(rows, t), component(rows, t)) if f is not None]
    return out + drift(rows, t) + bypass(rows, t) + jump(rows, t)
