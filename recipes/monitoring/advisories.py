"""Health advisories: short warnings about a run's last step, from its metrics alone.

`advisories(history, thresholds)` is a pure function of the steps logged so far (the
rows of metrics.jsonl) and `monitor.advisories`; each advisory is one string,
"code: message". The loop prints an advisory when it starts (it was not raised for the
previous step) and writes the step's list to metrics.jsonl as `advisories`.

Limits: it sees only the numbers a step logs, so it cannot tell *why* (a reward with no
variance may be a too-easy or a too-hard dataset); a metric a step did not log (DPO has
no rollouts) raises nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ...config import AdvisoriesConfig

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


def advisories(history: Sequence[dict[str, Any]], t: AdvisoriesConfig) -> list[str]:
    """The advisories of the last step of `history` (oldest first), as "code: message"."""
    if not history:
        return []
    m, out = history[-1], []
    groups, signal = m.get("groups_scored"), m.get("groups_with_signal")
    if groups and signal is not None and 1 - signal / groups >= t.no_variance_groups:
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


def new_advisories(current: list[str], previous: list[str]) -> list[str]:
    """Those of `current` whose code was not raised in `previous` (what to print)."""
    before = {a.split(":", 1)[0] for a in previous}
    return [a for a in current if a.split(":", 1)[0] not in before]
