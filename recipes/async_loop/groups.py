"""A scored group (one prompt's samples) and which groups a step may train on
(`take_fresh`, pure): the staleness rule of recipes/async_loop."""

from __future__ import annotations

from dataclasses import dataclass

from ...actors.rollout import Rollout
from ...rewards.protocol import Score


@dataclass
class Group:
    """The scored samples of one prompt, from generation round `round_`."""

    rollouts: list[Rollout]
    scores: list[Score]
    round_: int

    @property
    def version(self) -> int:
        """The oldest policy_version among its samples' tokens (all equal without partial
        rollouts)."""
        return min(r.policy_version for r in self.rollouts)

    @property
    def newest(self) -> int:
        """The newest policy_version among its samples' tokens (the version that finished
        the group; `version` without partial rollouts)."""
        return max(max(r.policy_versions or [r.policy_version]) for r in self.rollouts)


def take_fresh(
    groups: list[Group],
    step: int,
    k: int,
    count: int,
    token_k: int | None = None,
    drop: bool = True,
) -> tuple[list[Group], list[Group], list[Group]]:
    """Split ready `groups` (in the order they finished) for training step `step`: up to
    `count` within bounds, those too old (dropped), and the rest (kept for later steps).

    A group is within bounds when `step − newest ≤ k` and `step − version ≤ token_k`
    (its oldest token; `token_k` None: `k`, i.e. staleness counts from the oldest token).
    Of those, the `count` closest to going stale are taken (earliest deadline
    `min(newest + k, version + token_k)` first; ties in the order given), so a group
    left waiting is not dropped while younger ones train. With `drop` False
    (`train.staleness_policy: budget`) no group is too old: one past its deadline is
    taken first, the most overdue first. Pure; each list keeps the order of `groups`."""
    token_k = k if token_k is None else token_k
    stale, within = [], []
    for g in groups:
        old = step - g.newest > k or step - g.version > token_k
        (stale if old and drop else within).append(g)
    by_deadline = sorted(within, key=lambda g: min(g.newest + k, g.version + token_k))
    chosen = {id(g) for g in by_deadline[:count]}
    fresh = [g for g in within if id(g) in chosen]
    rest = [g for g in within if id(g) not in chosen]
    return fresh, stale, rest
