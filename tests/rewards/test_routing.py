"""Rewards routed by `data_source`: a component with `sources` scores only the rows
those name, in the reward service and in the controller's RewardSet; the built-in
`reasoning_gym` reward scores through the service; verl's `extra_info` reaches a python
reward as verl passes it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from posttrain.rewards.client import RewardSet
from posttrain.rewards.protocol import Score, ScoreItem
from posttrain.rewards.service import create_app


def _item(uid, response, source, ground_truth=None, **meta):
    return ScoreItem(
        uid=uid,
        response=response,
        ground_truth=ground_truth,
        metadata={"data_source": source, **meta} if source else meta,
    )


def test_service_scores_each_row_with_its_sources_components():
    ref = {"dataset": "leg_counting", "seed": 1, "size": 2, "config": {}, "index": 0}
    import reasoning_gym

    legs = reasoning_gym.create_dataset("leg_counting", seed=1, size=2)[0]["answer"]
    app = TestClient(
        create_app(
            [
                {"name": "correct", "type": "math", "sources": ["gsm8k"]},
                {
                    "name": "len",
                    "type": "length",
                    "target_chars": 3,
                    "weight": 0.5,
                    "sources": ["chat"],
                },
                {"name": "rg", "type": "reasoning_gym", "sources": ["leg_counting"]},
            ]
        )
    )
    items = [
        _item("m", "\\boxed{2}", "gsm8k", "2"),
        _item("c", "abc", "chat"),
        _item("r", f"<answer>{legs}</answer>", "leg_counting", reasoning_gym=ref),
        _item("x", "abc", "other"),
    ]
    got = app.post("/score", json={"items": [i.model_dump() for i in items]}).json()["scores"]
    assert got[0]["reward"] == 1.0 and set(got[0]["details"]) >= {"correct"}
    assert "len" not in got[0]["details"] and "rg" not in got[0]["details"]
    assert got[1]["reward"] == 0.5 and set(got[1]["details"]) == {"len", "len.chars"}
    assert got[2]["reward"] == 1.0 and got[2]["details"]["rg.answer_found"] == 1.0
    assert (
        got[3]["reward"] is None
        and "no component applies to data_source 'other'" in (got[3]["error"])
    )


class _Fake:
    """A reward client that scores every item `value` and records what it was sent."""

    def __init__(self, value):
        self.value, self.sent = value, []

    def score(self, items):
        self.sent += [i.uid for i in items]
        return [Score(uid=i.uid, reward=self.value) for i in items]

    def close(self):
        pass


def test_reward_set_sends_each_item_only_where_it_applies():
    local, ep = _Fake(1.0), _Fake(0.25)
    rs = RewardSet(local, [("ep", 2.0, ep)], [["a"]], {"ep": ["b"]})
    scores = rs.score([_item("a", "", "a"), _item("b", "", "b"), _item("c", "", "c")])
    assert local.sent == ["a"] and ep.sent == ["b"]
    assert [s.reward for s in scores] == [1.0, 0.5, None]
    assert scores[1].details == {"ep": 0.25}
    assert scores[2].error == "no reward component applies to data_source 'c'"
    # no sources anywhere: every item goes everywhere (as before)
    every = RewardSet(_Fake(1.0), [("ep", 2.0, _Fake(0.25))])
    assert [s.reward for s in every.score([_item("a", "", None)])] == [pytest.approx(1.5)]


def test_python_reward_gets_verls_extra_info():
    app = TestClient(
        create_app(
            [{"name": "i", "type": "python", "function": "tests.rewards.user_rewards:extra_index"}]
        )
    )
    item = _item("v", "x", "openai/gsm8k", "1", extra_info={"split": "train", "index": 7})
    [s] = app.post("/score", json={"items": [item.model_dump()]}).json()["scores"]
    assert s["reward"] == 7.0
