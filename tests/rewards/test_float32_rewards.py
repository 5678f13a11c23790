"""A reward must be finite in float32, the dtype rewards train in: 1e39 is a finite
float64 and `inf` as a float32, and one such reward turned its group's advantages into
NaN (the step was then skipped with no message). Every boundary refuses it as a failed
score naming its source; float32's largest value still passes."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.actors.rollout import Rollout
from posttrain.algorithms.grpo import group_advantages
from posttrain.common.numbers import FLOAT32_MAX, finite32
from posttrain.recipes.algo.rollouts import apply_failure_policy, rollout_batch, rollout_metrics
from posttrain.rewards.protocol import Score, ScoreItem, checked
from posttrain.rewards.python_reward import score_python

PAST_FLOAT32 = [1e39, -1e39, 3.5e38]


@pytest.mark.parametrize("x", PAST_FLOAT32)
def test_past_float32_is_not_finite(x):
    assert math.isfinite(x) and math.isinf(torch.tensor(x, dtype=torch.float32).item())
    assert not finite32(x)


def test_float32_range_itself_is_finite():
    assert finite32(FLOAT32_MAX) and finite32(-FLOAT32_MAX) and finite32(0) and finite32(1e38)
    assert not finite32(True) and not finite32(None) and not finite32(math.nan)


@pytest.mark.parametrize("x", PAST_FLOAT32)
def test_a_score_past_float32_fails_naming_its_source(x):
    got = checked(Score(uid="g0-1", reward=x), "http://verifier/score")
    assert got.reward is None
    assert got.error.startswith(f"http://verifier/score gave a non-finite reward ({x!r}) for g0-1")


def test_a_python_function_returning_1e39_is_refused():
    with pytest.raises(ValueError, match=r"compute_score returned 1e\+39; return a finite"):
        score_python(lambda *a: 1e39, ScoreItem(uid="a", response="x"))


def _rollouts(n: int) -> list[Rollout]:
    return [
        Rollout(f"g0-{i}", "g0", [1, 2], [3, 4], [-0.1, -0.2], "stop", 0, "", "") for i in range(n)
    ]


def test_1e39_never_reaches_the_advantages():
    """The given case: a group [1e39, 0.5, 0.2, 0.1]. The last guard before the
    advantages counts 1e39 as a failure (a boundary already failed it); the group's
    other advantages stay finite, and the step reports the failed score."""
    rollouts = _rollouts(4)
    scores = [
        Score(uid=r.uid, reward=x) for r, x in zip(rollouts, [1e39, 0.5, 0.2, 0.1], strict=True)
    ]
    rewards = apply_failure_policy(scores, rollouts, "zero")
    assert rewards == [0.0, 0.5, 0.2, 0.1]
    rollout_batch(rollouts, rewards, pad_id=0)
    reward_t = torch.tensor([math.nan if x is None else x for x in rewards])  # as GRPO's step
    adv = group_advantages(reward_t, [r.group_id for r in rollouts])
    assert torch.isfinite(adv).all(), adv
    assert rollout_metrics(rollouts, scores)["failed_scores"] == 1.0


def test_reward_model_scores_past_float32_fail_their_items(monkeypatch):
    from posttrain.config.rewards import RewardModelReward
    from posttrain.rewards.reward_model import RewardModelScorer

    scorer = RewardModelScorer.__new__(RewardModelScorer)  # no model: raw scores stubbed
    scorer.spec = RewardModelReward(name="rm", type="reward_model", path="/m", normalize="none")
    monkeypatch.setattr(scorer, "raw_scores", lambda items: [1e39, 2.0][: len(items)])
    got = scorer.score_batch([ScoreItem(uid=u, response="x") for u in "ab"])
    assert isinstance(got[0], ValueError) and "1e+39" in str(got[0]), got
    assert got[1] == (2.0, {})
