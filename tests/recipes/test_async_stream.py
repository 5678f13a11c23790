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


def test_budget_takes_an_overdue_group_first_and_drops_none():
    """`train.staleness_policy: budget`: "a" (version 1) is past k = 1 at step 3; it
    trains first instead of being dropped."""
    groups = [_group(3, "c"), _group(2, "b"), _group(1, "a", [1, 2, 3]), _group(3, "d")]
    fresh, stale, rest = take_fresh(groups, step=3, k=1, count=2, drop=False)
    assert [g.rollouts[0].group_id for g in fresh] == ["b", "a"] and not stale
    assert [g.rollouts[0].group_id for g in rest] == ["c", "d"]
    dropped = take_fresh(groups, step=3, k=1, count=2)[1]
    assert [g.rollouts[0].group_id for g in dropped] == ["a"]


def _stream(tmp_path, policy: str):
    """A RolloutStream without its producer (no engines): `ready` is filled by hand."""
    from types import SimpleNamespace

    from posttrain.recipes.async_loop import RolloutStream
    from posttrain.recipes.loading import load_recipe
    from tests.conftest import ROOT

    sets = [
        "train.max_staleness=1",
        "train.prompts_per_step=2",
        "rollout.engine=hf",
        "rollout.partial=true",
        "rollout.oversample=2.0",
        f"train.staleness_policy={policy}",
        "train.correction.mode=decoupled",
    ]
    recipe = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", sets)
    run = SimpleNamespace(recipe=recipe, roles=None, prompts=None, run_dir=tmp_path)
    return RolloutStream(run, start_version=3, produce=False)


def _fill(stream, groups):
    with stream.cond:
        stream.ready += groups
        stream.outstanding += len(groups)
        stream.counts.generated += sum(len(g.rollouts) for g in groups)


def test_budget_stream_trains_every_sample_and_the_counts_add_up(tmp_path):
    """Steps 3 and 4 of a stream whose buffer holds a long group started at version 1
    (oldest token 1, newest 3) beside fresh ones: with budget it trains at step 3 and
    nothing is dropped, generated = trained + dropped + waiting with dropped 0; with
    drop the same group is dropped."""
    for policy, dropped in (("budget", 0), ("drop", 1)):
        stream = _stream(tmp_path, policy)
        assert stream.window == 4  # ceil(1 × 2 × 2.0): the buffer the producer fills
        _fill(stream, [_group(3, "c"), _group(1, "a", [1, 2, 3]), _group(2, "b")])
        taken, stale, _ = stream.take(3)
        assert sum(len(g.rollouts) for g in stale) == dropped
        counts = stream.sample_counts()
        assert counts.dropped == dropped and counts.trained == 2
        assert counts.generated == counts.trained + counts.dropped + counts.waiting
        if policy == "budget":
            assert [g.rollouts[0].group_id for g in taken] == ["a", "b"]
            assert stream.outstanding == 1  # room for 3 more in the buffer of 4
            _fill(stream, [_group(4, "d")])
            assert [g.rollouts[0].group_id for g in stream.take(4)[0]] == ["c", "d"]
            final = stream.sample_counts()
            assert (final.generated, final.trained, final.dropped, final.waiting) == (4, 4, 0, 0)
        stream.close()
