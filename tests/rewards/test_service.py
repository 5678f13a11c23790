"""The reward service over real HTTP: protocol, order, auth, and failure semantics."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from posttrain.common.net import free_port
from posttrain.rewards.client import RewardClient, start_local_service
from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.service import create_app

COMPONENTS = [{"name": "correct", "type": "math", "weight": 1.0}]


def _items(pairs):
    return [
        ScoreItem(uid=f"u{i}", prompt="What is it?", response=r, ground_truth=g)
        for i, (r, g) in enumerate(pairs)
    ]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("svc") / "reward.log"
    proc = start_local_service(json.dumps(COMPONENTS), port, "secret", log)
    client = RewardClient(f"http://127.0.0.1:{port}/score", token="secret", retries=0)
    client.wait_ready(timeout_s=60, proc=proc)
    yield port, client
    client.close()
    proc.terminate()
    proc.wait(timeout=10)


def test_five_items_in_order_with_details(service):
    _, client = service
    items = _items(
        [
            ("\\boxed{2}", "2"),
            ("I don't know.", "2"),
            ("", "5"),
            ("\\boxed{137}", "5"),
            ("\\boxed{5}", "5"),
        ]
    )
    scores = client.score(items)
    assert [s.uid for s in scores] == [i.uid for i in items]
    assert [s.reward for s in scores] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert scores[3].details["correct.extracted"] == "137"


# Issue #12's values, scored by the real service over HTTP: LaTeX golds, plus signs,
# text after the final answer, hedging; plain and GSM8K golds keep working.
ISSUE_12 = [
    ("The answer is \\boxed{2}.", "2\\sqrt{2}", 0.0),
    ("The answer is \\boxed{2\\sqrt{2}}.", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("Therefore the answer is +7", "+7", 1.0),
    ("2+40=42\n#### 42\nThis matches step 3 of the plan.", "42", 1.0),
    ("The answer is 1234 or maybe 12.", "1234", 0.0),
    ("The total is 1234.", "1234", 1.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("The answer is 3/4.", "3/4", 1.0),
    ("#### 0.5", "0.5", 1.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "She sold 48/2 = <<48/2=24>>24.\n#### 72", 1.0),
]


@pytest.mark.parametrize(("response", "gold", "want"), ISSUE_12)
def test_issue_12_values_over_http(service, response, gold, want):
    _, client = service
    score = client.score(_items([(response, gold)]))[0]
    assert score.reward == want, score.details


def test_batches_are_split_and_stay_aligned(service):
    port, _ = service
    client = RewardClient(f"http://127.0.0.1:{port}/score", token="secret", batch_size=2)
    items = _items([(str(i), str(i % 2)) for i in range(5)])
    assert [s.reward for s in client.score(items)] == [1.0, 1.0, 0.0, 0.0, 0.0]
    client.close()


def test_missing_token_is_401(service):
    port, _ = service
    client = RewardClient(f"http://127.0.0.1:{port}/score", retries=0)
    scores = client.score(_items([("1", "1")]))
    assert scores[0].reward is None and "401" in scores[0].error
    client.close()


def test_dead_endpoint_fails_items_after_retries_never_zero():
    client = RewardClient(
        f"http://127.0.0.1:{free_port()}/score", retries=2, backoff_s=0.01, timeout_s=2
    )
    scores = client.score(_items([("1", "1"), ("2", "2")]))
    assert [s.reward for s in scores] == [None, None]
    assert all("request failed" in s.error for s in scores)


def test_item_without_ground_truth_fails_alone():
    app = TestClient(create_app(COMPONENTS))
    body = {
        "items": [{"uid": "a", "response": "1", "ground_truth": "1"}, {"uid": "b", "response": "1"}]
    }
    scores = app.post("/score", json=body).json()["scores"]
    assert scores[0]["reward"] == 1.0
    assert scores[1]["reward"] is None and "ground_truth" in scores[1]["error"]


def test_duplicate_uids_rejected():
    app = TestClient(create_app(COMPONENTS))
    body = {"items": [{"uid": "a", "response": "1"}, {"uid": "a", "response": "2"}]}
    assert app.post("/score", json=body).status_code == 422


def test_unknown_component_type_refused():
    with pytest.raises(ValueError, match="does not match any of the expected tags"):
        create_app([{"name": "x", "type": "nope", "weight": 1.0}])
    with pytest.raises(ValueError, match="not served here"):
        create_app([{"name": "x", "type": "http", "url": "http://127.0.0.1:1/score"}])


def test_components_are_weighted_and_reported():
    comps = COMPONENTS + [{"name": "short", "type": "length", "weight": 0.5, "target_chars": 4}]
    app = TestClient(create_app(comps))
    body = {
        "items": [
            {"uid": "a", "response": "7777", "ground_truth": "7777"},
            {"uid": "b", "response": "12", "ground_truth": "3"},
        ]
    }
    a, b = app.post("/score", json=body).json()["scores"]
    assert a["reward"] == pytest.approx(1.0 + 0.5 * 1.0)
    assert b["reward"] == pytest.approx(0.0 + 0.5 * 0.5)
    assert b["details"]["short"] == 0.5 and b["details"]["correct"] == 0.0


def test_format_reward():
    app = TestClient(create_app([{"name": "f", "type": "format", "pattern": r"^\s*\d+\s*$"}]))
    body = {"items": [{"uid": "a", "response": " 42 "}, {"uid": "b", "response": "42 apples"}]}
    assert [s["reward"] for s in app.post("/score", json=body).json()["scores"]] == [1.0, 0.0]
