"""Off-policy accounting of the asynchronous loop (`train.max_staleness` ≥ 1), pure.

Per step: how many policy versions each trained trajectory spans (more than one only
with partial rollouts, `rollout.partial`), the distribution of staleness over the
trained samples, and sample counts that add up over the run:

    samples_generated_total = samples_trained_total + samples_dropped_total
                              + samples_waiting

(generated: scored; trained: taken into a batch; dropped: too old at `take`, or, with
`grpo.dynamic_sampling`, in a group whose rewards are all equal (DAPO; also counted in
`samples_dropped_flat_total`), never trained on; waiting: scored, not yet taken).
Samples still generating or scoring are in none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...actors.rollout import Rollout


@dataclass
class SampleCounts:
    """Running totals of samples through the stream (under its lock)."""

    generated: int = 0
    trained: int = 0
    dropped: int = 0  # stale or flat
    flat: int = 0  # dynamic sampling: dropped for a group without signal

    @property
    def waiting(self) -> int:
        return self.generated - self.trained - self.dropped


def versions_of(r: Rollout) -> list[int]:
    """The policy_version of each response token (`[R]`; every token the sample's own
    version without partial rollouts; `[policy_version]` for an empty response)."""
    if r.policy_versions:
        return r.policy_versions
    return [r.policy_version] * max(len(r.response_ids), 1)


def offpolicy_metrics(
    rollouts: Sequence[Rollout], step: int, k: int, counts: SampleCounts, dropped: int
) -> dict[str, float]:
    """Metrics of the samples `rollouts` trained at `step` under staleness bound `k`
    (with `train.max_token_staleness`, the larger of the two bounds).

    Returns:
        `staleness_mean`, `staleness_max` (step − oldest version of each sample),
        `staleness_newest_mean`, `staleness_newest_max` (step − newest version of each
        sample; the same without partial rollouts; may exceed `train.max_staleness`
        where a group's samples ended at different versions, since the bound is on the
        group's newest token, recipes/async_loop/groups.py `take_fresh`),
        `staleness_frac/{d}` for d = 0..max(k, staleness_max) (share of samples at
        staleness d; they sum to 1; past k only with `train.staleness_policy: budget`),
        `staleness_token_mean` (step − version of each response token),
        `versions_spanned_mean`, `versions_spanned_max` (distinct versions per sample),
        `samples_trained`, `samples_dropped` (this step), and the run's totals
        `samples_generated_total`, `samples_trained_total`, `samples_dropped_total`,
        `samples_waiting`, `samples_dropped_flat_total` (see the module docstring for
        how they add up).

    Raises:
        ValueError: `rollouts` is empty (a step trains on at least one group).
    """
    if not rollouts:
        raise ValueError(f"step {step}: no samples to account for")
    lag = [step - r.policy_version for r in rollouts]
    newest = [step - max(versions_of(r)) for r in rollouts]
    token_lag = [step - v for r in rollouts for v in versions_of(r)]
    spans = [len(set(versions_of(r))) for r in rollouts]
    out = {
        "staleness_mean": sum(lag) / len(lag),
        "staleness_max": float(max(lag)),
        "staleness_newest_mean": sum(newest) / len(newest),
        "staleness_newest_max": float(max(newest)),
        "staleness_token_mean": sum(token_lag) / len(token_lag),
        "versions_spanned_mean": sum(spans) / len(spans),
        "versions_spanned_max": float(max(spans)),
        "samples_trained": float(len(rollouts)),
        "samples_dropped": float(dropped),
        "samples_generated_total": float(counts.generated),
        "samples_trained_total": float(counts.trained),
        "samples_dropped_total": float(counts.dropped),
        "samples_dropped_flat_total": float(counts.flat),
        "samples_waiting": float(counts.waiting),
    }
    for d in range(max(k, *lag) + 1):  # past k with train.staleness_policy: budget
        out[f"staleness_frac/{d}"] = sum(x == d for x in lag) / len(lag)
    return out
