"""Hostile answers at the reward boundaries the controller and the reward service call
out to: `type: http` reward endpoints (both protocols), LLM judges, python functions and
reward models. A non-finite number (`NaN`, `Infinity`, `1e400`, an overflowing digit
string) becomes a failed score naming its source, never a reward; a server that drips
its answer a byte at a time is cut off at the request's `timeout_s` (the whole request,
not each read). Timing assertions are loose (3× the timeout): a hang fails the test."""

from __future__ import annotations

import math
import time

import pytest
from fastapi.testclient import TestClient

from posttrain.actors.rollout import Rollout
from posttrain.config.rewards import JudgeReward
from posttrain.recipes.algo.rollouts import apply_failure_policy, rollout_metrics
from posttrain.rewards.client import RewardClient, RewardSet
from posttrain.rewards.judge import JudgeError, JudgeScorer, parse_score
from posttrain.rewards.protocol import Score, ScoreItem
from posttrain.rewards.service import create_app
from tests.hostile_servers import SlowDrip

NON_FINITE = {
    "nan": "NaN",
    "infinity": "Infinity",
    "1e400": "1e400",
    "-infinity": "-Infinity",
    "1e39": "1e39",  # finite as a float64, inf in float32: NaN advantages
}
ITEMS = [ScoreItem(uid=u, response="r") for u in ("a", "b")]


def _client(url: str, **kw) -> RewardClient:
    return RewardClient(url, retries=0, backoff_s=0.0, **kw)


@pytest.mark.parametrize("literal", sorted(NON_FINITE.values()))
def test_http_endpoint_non_finite_reward_fails_that_item(literal):
    body = f'{{"scores": [{{"uid": "a", "reward": {literal}}}, {{"uid": "b", "reward": 0.5}}]}}'
    with SlowDrip(body, interval_s=0) as url:
        client = _client(f"{url}/score")
        a, b = client.score(ITEMS)
        client.close()
    assert a.reward is None and "non-finite reward" in a.error and url in a.error, a
    assert b.reward == 0.5 and b.error is None


@pytest.mark.parametrize("literal", sorted(NON_FINITE.values()))
def test_openrlhf_endpoint_non_finite_reward_fails_that_item(literal):
    with SlowDrip(f'{{"rewards": [{literal}, 0.25]}}', interval_s=0) as url:
        client = _client(f"{url}/score", protocol="openrlhf")
        a, b = client.score(ITEMS)
        client.close()
    assert a.reward is None and "non-finite reward" in a.error and url in a.error, a
    assert b.reward == 0.25


def test_non_finite_detail_of_an_endpoint_is_kept_as_text():
    body = '{"scores": [{"uid": "a", "reward": 1.0, "details": {"ratio": NaN, "n": 3}}]}'
    with SlowDrip(body, interval_s=0) as url:
        client = _client(f"{url}/score")
        (a,) = client.score(ITEMS[:1])
        client.close()
    assert a.reward == 1.0 and a.details == {"ratio": "nan", "n": 3}


def test_reward_set_names_the_component_and_catches_an_overflowing_sum():
    body = '{"scores": [{"uid": "a", "reward": 1e38}, {"uid": "b", "reward": NaN}]}'
    with SlowDrip(body, interval_s=0) as url:
        rs = RewardSet(None, [("remote", 10.0, _client(f"{url}/score"))])
        a, b = rs.score(ITEMS)
        rs.close()
    assert a.reward is None and "weighted sum" in a.error, a  # 10 × 1e38 is past float32
    assert b.reward is None and b.error.startswith("remote: ") and "non-finite" in b.error


def test_a_step_with_failed_scores_keeps_finite_metrics_and_advantages():
    """What a NaN reward did before: `statistics.pstdev` raised AttributeError
    ('float' object has no attribute 'numerator') on an infinite reward."""
    rollouts = [
        Rollout(f"g-{k}", "g", [1], [2, 3], [-0.1, -0.2], "stop", 0, "p", "r") for k in range(3)
    ]
    body = (
        '{"scores": [{"uid": "g-0", "reward": Infinity}, {"uid": "g-1", "reward": 1.0}, '
        '{"uid": "g-2", "reward": 0.0}]}'
    )
    with SlowDrip(body, interval_s=0) as url:
        client = _client(f"{url}/score")
        scores = client.score([ScoreItem(uid=r.uid, response="r") for r in rollouts])
        client.close()
    assert [s.reward for s in scores] == [None, 1.0, 0.0]
    m = rollout_metrics(rollouts, scores)
    assert m["failed_scores"] == 1.0 and m["reward_mean"] == 0.5 and m["reward_std"] == 0.5
    got = apply_failure_policy(scores, rollouts, "zero")
    assert got == [0.0, 1.0, 0.0]


def test_rollout_metrics_ignore_a_non_finite_reward_that_slipped_through():
    r = Rollout("g-0", "g", [1], [2], [-0.1], "stop", 0, "p", "r")
    m = rollout_metrics([r, r], [Score(uid="x", reward=math.inf), Score(uid="y", reward=1.0)])
    assert m["failed_scores"] == 1.0 and m["reward_mean"] == 1.0


# --- judges -------------------------------------------------------------------------


def _judge_reply(content: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


def _judge(url: str, **kw) -> JudgeScorer:
    spec = JudgeReward(name="j", type="judge", url=url, model="m", retries=0, **kw)
    return JudgeScorer(spec, backoff_s=0.0)


def test_parse_score_refuses_non_finite():
    pattern = JudgeReward.model_fields["score_pattern"].default
    with pytest.raises(JudgeError, match="not a finite number"):
        parse_score("Score: " + "9" * 400, pattern, None)  # float() of it is inf
    with pytest.raises(JudgeError, match="not a finite number"):
        parse_score("Score: nan", r"Score: (\S+)", None)


@pytest.mark.parametrize(
    "reply", ["Score: " + "9" * 400, "Score: inf", "Score: NaN", "Score: 1e39"]
)
def test_judge_non_finite_score_fails_the_item_through_the_service(reply):
    with SlowDrip(_judge_reply(reply), interval_s=0) as url:
        comp = {
            "name": "j",
            "type": "judge",
            "url": url,
            "model": "m",
            "retries": 0,
            "score_pattern": r"Score: (\S+)",
        }
        with TestClient(create_app([comp], workers=1)) as client:
            (s,) = client.post("/score", json={"items": [{"uid": "a", "response": "x"}]}).json()[
                "scores"
            ]
    assert s["reward"] is None and s["error"].startswith("j: ") and "finite" in s["error"], s


# --- python functions through the service -------------------------------------------


PY = {"name": "user", "type": "python", "function": "tests.rewards.user_rewards:echo_number"}


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "1e39"])
def test_python_function_non_finite_fails_the_item(text):
    with TestClient(create_app([PY], workers=1)) as client:
        (s,) = client.post("/score", json={"items": [{"uid": "a", "response": text}]}).json()[
            "scores"
        ]
    assert s["reward"] is None and s["error"].startswith("user: "), s


def test_python_function_non_finite_detail_does_not_fail_the_batch():
    """A NaN among a dict result's other keys came back as a bare null; it is kept as
    its text."""
    with TestClient(create_app([PY], workers=1)) as client:
        resp = client.post(
            "/score",
            json={"items": [{"uid": "a", "response": "details"}, {"uid": "b", "response": "2"}]},
        )
    assert resp.status_code == 200, resp.text
    a, b = resp.json()["scores"]
    assert a["reward"] == 0.5 and a["details"]["user.ratio"] == "nan"
    assert b["reward"] == 2.0


# --- slow drips: timeout_s bounds the whole request ----------------------------------

TIMEOUT_S = 1.0


@pytest.mark.parametrize("drip_headers", [False, True], ids=["body", "headers"])
def test_http_reward_endpoint_drip_is_cut_at_the_deadline(drip_headers):
    body = {"scores": [{"uid": "a", "reward": 1.0}, {"uid": "b", "reward": 1.0}]}
    with SlowDrip(body, drip_headers=drip_headers) as url:
        client = _client(f"{url}/score", timeout_s=TIMEOUT_S)
        t0 = time.monotonic()
        scores = client.score(ITEMS)
        took = time.monotonic() - t0
        client.close()
    assert [s.reward for s in scores] == [None, None], scores
    assert "timeout_s" in scores[0].error, scores[0].error
    assert took < 3 * TIMEOUT_S, took


@pytest.mark.parametrize("drip_headers", [False, True], ids=["body", "headers"])
def test_judge_drip_is_cut_at_the_deadline(drip_headers):
    with SlowDrip(_judge_reply("Score: 7"), drip_headers=drip_headers) as url:
        scorer = _judge(url, timeout_s=TIMEOUT_S)
        t0 = time.monotonic()
        with pytest.raises(JudgeError, match="timeout_s"):
            scorer(ScoreItem(uid="u", response="r"))
        took = time.monotonic() - t0
        scorer.close()
    assert took < 3 * TIMEOUT_S, took
