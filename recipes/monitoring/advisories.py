"""Health advisories: short warnings about a run's last step, from its metrics alone.

`advisories(history, thresholds)` is a pure function of the steps logged so far (the
rows of metrics.jsonl) and `monitor.advisories`; each advisory is one string,
"code: message". The loop writes the step's list to metrics.jsonl as `advisories` and
prints an advisory once, at the step it starts (`console_lines`). `advisory_ranges`
groups consecutive steps that raise the same code into one range, for `posttrain status`
and the dashboard.

Limits: it sees only the numbers a step logs, so it cannot tell *why* (a reward with no
variance may be a too-easy or a too-hard dataset); a metric a step did not log (DPO has
no rollouts) raises nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from ...config import AdvisoriesConfig, Recipe

CODES = (
    "no_variance",
    "truncated",
    "slow_step",
    "failed_rewards",
    "logprob_mismatch",
    "rollout_idle",
    "learner_idle",
    "skipped_updates",
)


def advisories(
    history: Sequence[dict[str, Any]], t: AdvisoriesConfig, reward_signal: bool = True
) -> list[str]:
    """The advisories of the last step of `history` (oldest first), as "code: message".
    `reward_signal`: whether rewards drive the update (`AlgorithmFacts.
    reward_drives_advantage`); without it, groups with no reward variance are no fault
    (`no_variance` is not raised)."""
    if not history:
        return []
    m, out = history[-1], []
    groups, signal = m.get("groups_scored"), m.get("groups_with_signal")
    flat = groups and signal is not None and 1 - signal / groups >= t.no_variance_groups
    if reward_signal and flat:
        out.append(
            f"no_variance: {1 - signal / groups:.0%} of groups have no reward variance "
            f"(≥ {t.no_variance_groups:.0%}): no learning signal; make prompts "
            "harder/easier or raise rollout.samples_per_prompt"
        )
    trunc = m.get("truncated_fraction")
    if trunc is not None and trunc >= t.truncated:
        out.append(
            f"truncated: {trunc:.0%} of responses hit max_new_tokens "
            f"(≥ {t.truncated:.0%}); raise rollout.max_new_tokens"
        )
    before = [r["time/step"] for r in history[:-1] if r.get("time/step") is not None]
    now = m.get("time/step")
    if before and now is not None and now >= t.slow_step * statistics.median(before):
        out.append(
            f"slow_step: step took {now:.1f} s, {now / statistics.median(before):.1f}× "
            f"the median {statistics.median(before):.1f} s (≥ {t.slow_step:g}×)"
        )
    failed = m.get("failed_scores") or 0
    if failed >= t.failed_rewards:
        out.append(
            f"failed_rewards: {failed:.0f} rollouts could not be scored; see the "
            "reward errors in RUN_DIR/rollouts/"
        )
    mismatch = m.get("logprob_mismatch")
    if mismatch is not None and mismatch > t.logprob_mismatch:
        lag = m.get("staleness_max") or 0
        why = (
            f"samples up to {lag:.0f} policy versions old (train.max_staleness), so part "
            "of it is the policy's own change; train.correction weighs it"
            if lag
            else "check model.dtype and the weight push"
        )
        out.append(
            f"logprob_mismatch: learner and engine logprobs differ by {mismatch:.3f} "
            f"(> {t.logprob_mismatch:g}); {why}"
        )
    skipped = m.get("skipped_updates") or 0
    if skipped > 0:
        out.append(
            f"skipped_updates: {skipped:.0f} optimizer update(s) of this step not applied: "
            "the loss or gradient norm was NaN or infinite (weights and AdamW state "
            "unchanged); check rewards and advantages for NaN/inf, or lower train.lr"
        )
    for side in ("rollout", "learner"):
        key = f"{side}_idle_fraction"
        recent = [r.get(key) for r in history[-t.idle_steps :]]
        if len(recent) == t.idle_steps and all(v is not None and v > t.idle for v in recent):
            out.append(
                f"{side}_idle: {side} idle > {t.idle:.0%} of the step for "
                f"{t.idle_steps} steps (now {recent[-1]:.0%}); move devices to the "
                "other side (posttrain plan shows the split)"
            )
    return out


def code_of(advisory: str) -> str:
    """The code of a "code: message" advisory."""
    return advisory.split(":", 1)[0]


@dataclass(frozen=True)
class AdvisoryRange:
    """One advisory raised at every step from `first` to `last` (inclusive); `message`
    is the whole "code: message" string of the last of those steps (its numbers are the
    newest)."""

    code: str
    first: int
    last: int
    message: str

    @property
    def steps(self) -> str:
        """ "step 3" or "steps 0–19" (an en dash)."""
        if self.first == self.last:
            return f"step {self.first}"
        return f"steps {self.first}–{self.last}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "first": self.first,
            "last": self.last,
            "steps": self.steps,
            "message": self.message,
        }


def advisory_ranges(rows: Sequence[dict[str, Any]]) -> list[AdvisoryRange]:
    """Advisories of metrics.jsonl `rows` (ascending steps) grouped into ranges: a code
    raised at steps s and s + 1 is one range; a step that does not raise it (or a step
    missing from `rows`) ends the range. Rows without an `advisories` list (the final
    evaluation's row) are skipped. Ordered by first step, then as `advisories` raises
    them (CODES).

    Example: truncated at steps 0, 1, 2 and 5, failed_rewards at 1 gives
    [truncated 0–2, failed_rewards 1–1, truncated 5–5].
    """
    done: list[AdvisoryRange] = []
    open_: dict[str, AdvisoryRange] = {}  # code -> its range that reached the last step
    for row in rows:
        if not isinstance(row.get("advisories"), list):
            continue
        step = int(row["step"])
        now: dict[str, AdvisoryRange] = {}
        for a in row["advisories"]:
            code = code_of(a)
            was = open_.pop(code, None)
            first = was.first if was is not None and was.last == step - 1 else step
            if was is not None and first == step:
                done.append(was)
            now[code] = AdvisoryRange(code, first, step, a)
        done.extend(open_.values())
        open_ = now
    done.extend(open_.values())
    order = {c: i for i, c in enumerate(CODES)}  # the order advisories() raises them in
    return sorted(done, key=lambda r: (r.first, order.get(r.code, len(CODES))))


def console_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the loop prints after logging the last of `rows`: one line per advisory range,
    at the step it starts ("step 3: advisory truncated: 62% of ..."). A range's end is not
    printed (a closing "advisory truncated: steps 0–2" repeated every advisory on the
    console); `posttrain status` and the dashboard show each range's steps."""
    if not rows:
        return []
    step = int(rows[-1]["step"])
    return [f"step {step}: advisory {r.message}" for r in advisory_ranges(rows) if r.first == step]


def advise(
    history: list[dict[str, Any]],
    metrics: dict[str, Any],
    recipe: Recipe,
    extra: Sequence[str] = (),
) -> None:
    """Puts the step's health advisories, then the `extra` ones (the reward-hacking
    firings, recipes/monitoring/evidence.py), into `metrics` and prints those that
    started at this step."""
    metrics["advisories"] = [
        *advisories(
            [*history, metrics], recipe.monitor.advisories, recipe.facts.reward_drives_advantage
        ),
        *extra,
    ]
    for line in console_lines([*history, metrics]):
        tqdm.write(line)
