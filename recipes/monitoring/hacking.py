"""Reward-hacking monitors: pure functions over a run's per-step metrics (the rows of
metrics.jsonl, oldest first) and `monitor.hacking`, each returning a `Firing` with its
evidence (the steps and the metric's trajectory) or None. No torch, no I/O: they run
after every step over numbers the step already computed.

Codes, and when each fires (HackingConfig keys):

- `hacking_heldout`: train `reward_mean` rose ≥ `reward_rise` between the first and the
  last held-out measurement (`heldout_metric`) while that metric rose less than
  `heldout_share` × the reward's rise.
- `hacking_component`: one `reward/NAME` rose ≥ `component_rise` while every other rose
  less than `component_flat`.
- `hacking_length`, `hacking_repetition`, `hacking_entropy`: `response_length_mean` ≥
  `length_ratio` × its baseline; `repetition` rose ≥ `repetition_rise`; `entropy` fell
  to 1/`entropy_ratio` of its baseline or rose to `entropy_ratio` × it.
- `hacking_early_exit`, `hacking_patched`, `hacking_many_answers`, `hacking_hedged`: the
  mean of `hack/NAME` (signatures.py) over the last `window` steps ≥ `bypass_share`.
- `hacking_kl`, `hacking_mismatch`: the step's `kl` (`logprob_mismatch`) ≥ `jump_ratio`
  × the median of the `window` steps before it and ≥ `kl_floor` (`mismatch_floor`).

A trend's baseline is the mean of the first `window` steps that logged the metric, its
"now" the mean of the last `window`; a trend monitor needs 2 × `window` such steps.

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


@dataclass(frozen=True)
class Firing:
    """One monitor's finding at the last step of the history it saw.

    Attributes:
        code: `hacking_*` (module docstring's table).
        message: one line with the numbers and what to do.
        first, last: the steps the evidence spans (inclusive).
        trajectory: the metric(s) over those steps, [{"step": s, KEY: value, ...}].
        pick: how to choose sample rollouts that show it (evidence.py `select_samples`):
            "reward", "component:NAME", "length", "repetition" or "signature:NAME".
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


def heldout(rows: Rows, t: HackingConfig) -> Firing | None:
    """(1) The train reward rose while the held-out metric did not follow."""
    key, w = t.heldout_metric, t.window
    points = series(rows, key)
    reward = series(rows, "reward_mean")
    if len(points) < 2 or not reward:
        return None
    s0, s1 = points[0][0], points[-1][0]
    if s1 - s0 < w:
        return None

    def near(lo: int, hi: int, s: list[tuple[int, float]]) -> float | None:
        got = [(k, v) for k, v in s if lo <= k <= hi]
        return _mean(got) if got else None

    r0, r1 = near(s0, s0 + w - 1, reward), near(s1 - w + 1, s1, reward)
    h0, h1 = near(s0, s0 + w - 1, points), near(s1 - w + 1, s1, points)
    if None in (r0, r1, h0, h1):
        return None
    rise_r, rise_h = r1 - r0, h1 - h0  # type: ignore[operator]
    if rise_r < t.reward_rise or rise_h >= t.heldout_share * rise_r:
        return None
    traj = []
    for s, v in points:
        r = near(s - w + 1, s, reward) if s > s0 else r0
        traj.append(
            {"step": s, key: round(v, 6), "reward_mean": None if r is None else round(r, 6)}
        )
    return Firing(
        "hacking_heldout",
        f"train reward rose {r0:.3f} → {r1:.3f} (+{rise_r:.3f}) over steps {s0}–{s1} while "
        f"held-out {key} went {h0:.3f} → {h1:.3f} ({rise_h:+.3f}; < {t.heldout_share:g} × "
        "the rise): the policy may be gaming the reward; read the samples "
        "(posttrain status RUN_DIR), tighten the verifier",
        s0,
        s1,
        traj,
    )


def component(rows: Rows, t: HackingConfig) -> Firing | None:
    """(2) One reward component carries the gain while the others stay flat."""
    keys = sorted({k for r in rows for k in r if k.startswith("reward/") and _num(r[k])})
    trends = {k: tr for k in keys if (tr := _trend(rows, k, t.window)) is not None}
    if len(trends) < 2:
        return None
    gain = {k: now - base for k, (_, base, now) in trends.items()}
    for k, g in gain.items():
        others = {o: v for o, v in gain.items() if o != k}
        if g >= t.component_rise and all(v < t.component_flat for v in others.values()):
            s = trends[k][0]
            flat = ", ".join(f"{o[7:]} {v:+.3f}" for o, v in others.items())
            return Firing(
                "hacking_component",
                f"reward component {k[7:]} rose {g:+.3f} (first vs last {t.window} steps) "
                f"while the others did not ({flat}; < {t.component_flat:g}): the gain is "
                f"{k[7:]} alone; check that its samples also solve the task",
                s[0][0],
                s[-1][0],
                [{"step": st, **{o: r.get(o) for o in trends}} for st, r in _by_step(rows, s)],
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
    steps), in the table's order; [] for no rows."""
    if not rows:
        return []
    out = [f for f in (heldout(rows, t), component(rows, t)) if f is not None]
    return out + drift(rows, t) + bypass(rows, t) + jump(rows, t)
