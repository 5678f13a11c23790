"""The staleness rule of the asynchronous loop, as a pure function."""

from __future__ import annotations

from posttrain.actors.rollout import Rollout
from posttrain.recipes.async_loop import Group, take_fresh


def _group(version: int, name: str, versions: list[int] | None = None) -> Group:
    """One sample; `versions` per token (partial rollouts), its first the oldest."""
    tokens = len(versions or [version])
    r = Rollout(
        uid=f"{name}-0",
        group_id=name,
        prompt_ids=[1],
        response_ids=[2] * tokens,
        inference_logprobs=[-0.1] * tokens,
        finish_reason="stop",
        policy_version=version,
        prompt_text="",
        response_text="",
        policy_versions=versions,
    )
    return Group([r], [], round_=version)


def test_take_fresh_drops_groups_older_than_k_and_keeps_order():
    groups = [_group(1, "a"), _group(3, "b"), _group(2, "c"), _group(4, "d"), _group(4, "e")]
    fresh, stale, rest = take_fresh(groups, step=4, k=1, count=2)
    assert [g.group_id for g in (x.rollouts[0] for x in fresh)] == ["b", "d"]
    assert [g.rollouts[0].group_id for g in stale] == ["a", "c"]  # 4 − 1 = 3 > 1, 4 − 2 = 2 > 1
    assert [g.rollouts[0].group_id for g in rest] == ["e"]


def test_take_fresh_at_the_bound_and_short():
    groups = [_group(2, "a"), _group(3, "b")]
    fresh, stale, rest = take_fresh(groups, step=4, k=2, count=3)  # 4 − 2 = 2 ≤ 2: kept
    assert len(fresh) == 2 and not stale and not rest
    fresh, stale, _ = take_fresh(groups, step=5, k=2, count=1)
    assert [g.rollouts[0].group_id for g in stale] == ["a"]
    assert [g.rollouts[0].group_id for g in fresh] == ["b"]


def test_by_default_a_partial_group_is_as_old_as_its_oldest_token():
    g = _group(2, "a", [2, 3, 4])
    assert (g.version, g.newest) == (2, 4)
    fresh, stale, _ = take_fresh([g], step=4, k=1, count=1)
    assert not fresh and len(stale) == 1  # 4 − 2 = 2 > 1


def test_token_bound_keeps_a_continued_group_within_both_bounds():
    groups = [
        _group(2, "a", [2, 3, 4]),  # newest 4 − 4 = 0 ≤ 1, oldest 4 − 2 = 2 ≤ 2: fresh
        _group(1, "b", [1, 2, 3]),  # oldest 4 − 1 = 3 > 2: stale
        _group(2, "c", [2, 2, 2]),  # newest 4 − 2 = 2 > 1: stale
        _group(3, "d"),  # 1 ≤ 1: fresh
    ]
    fresh, stale, rest = take_fresh(groups, step=4, k=1, count=5, token_k=2)
    assert [g.rollouts[0].group_id for g in fresh] == ["a", "d"]
    assert [g.rollouts[0].group_id for g in stale] == ["b", "c"]
    assert not rest


def test_the_groups_closest_to_going_stale_train_first():
    """Earliest deadline first: at step 4, k 1, m 2 the continued group "a" (oldest
    token 2: stale after step 4) trains before "b" and "c" (fresh until step 5),
    though it finished last; the batch keeps the finishing order."""
    groups = [_group(4, "b"), _group(4, "c"), _group(2, "a", [2, 4])]
    fresh, stale, rest = take_fresh(groups, step=4, k=1, count=2, token_k=2)
    assert [g.rollouts[0].group_id for g in fresh] == ["b", "a"]
    assert [g.rollouts[0].group_id for g in rest] == ["c"] and not stale
