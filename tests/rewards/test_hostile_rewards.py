"""Hostile inputs to the in-process verifiers (math, format regex, python functions):
each call is bounded in time and memory, a cut-off item comes back `reward: null` with
an error naming the timeout, and the service keeps answering (/health included)
during and after; a non-finite result fails its item, never becomes a reward. Every
wait here has a generous bound: a hang fails the test, it never blocks the suite.

The rest of the hostile battery, by boundary: tests/rewards/test_hostile_endpoints.py
(non-finite answers and slow drips from http rewards, judges, python functions, reward
models), test_reward_model_folder.py (missing / truncated / broken folders),
test_service_restart.py (a crashed service back on its port),
tests/actors/test_openai_endpoint_hostile.py (the agent endpoint),
tests/recipes/test_environments.py (environments), tests/common/test_http.py."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from posttrain.common.net import free_port
from posttrain.rewards.client import start_local_service

COMPONENTS = [
    {"name": "correct", "type": "math", "timeout_s": 2, "memory_mb": 1024},
    # (a|aa)*$ backtracks exponentially on a long run of a's that ends badly
    {"name": "shape", "type": "format", "pattern": r"^(a|aa)*$", "timeout_s": 2, "weight": 0},
    {
        "name": "user",
        "type": "python",
        "function": "tests.rewards.user_rewards:runaway",
        "timeout_s": 2,
        "weight": 0,
    },
]
HOSTILE_MATH = {
    "power_tower": r"\boxed{9^{9^{9^{9^{9}}}}}",
    "huge_factorial": r"\boxed{1000000!}",
    "factorial_of_factorial": r"\boxed{(100!)!}",
    "double_exponent": r"\boxed{10^{10^{10}}}",
    "hash_tower": "#### 10^{10^{10^{10}}}",
    "answer_phrase_tower": "The answer is 9^9^9^9",
    "deep_parens": "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
    "deep_sqrt": "\\boxed{" + "\\sqrt{" * 2000 + "2" + "}" * 2000 + "}",
    "long_sum": "\\boxed{" + "+".join(["1"] * 100_000) + "}",
    "unclosed_boxes": "\\boxed{" * 50_000,
    "many_boxes": "\\boxed{1}" * 20_000,
    "million_digits": "7" * 1_000_000,
    "long_answer_phrase": "the answer is " + "x " * 500_000,
    "dollar_run": "$" * 200_000,
    # the answer shapes of the field reports, made large: currency, emphasis, #### headings
    "currency_run": "The answer is $1" + " $" * 100_000,
    "currency_digits": "The answer is $" + "1," * 100_000 + ".",
    "emphasis_run": "The answer is **7" + "*" * 200_000,
    "hash_headings": "#### Check\n" * 100_000,
    "prose_hash": "#### (" + "verified " * 50_000 + ")",
    "many_currency_answers": "The answer is $7.\n" * 20_000,
    "equation_tower": r"\boxed{x = 9^{9^{9^{9^{9}}}}}",
}
TIMEOUT = 60.0  # generous bound on every request: a hang fails, it does not block


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("svc") / "reward.log"
    proc = start_local_service(json.dumps(COMPONENTS), port, "t", log, workers=2)
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT, headers={"Authorization": "Bearer t"}
    )
    _wait_healthy(http, proc)
    yield http, proc
    http.close()
    proc.kill()
    proc.wait(timeout=30)


def _wait_healthy(http, proc, timeout_s=TIMEOUT):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the reward service exited"
        try:
            if http.get("/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the reward service did not answer /health")


def _wait_in_flight(http, timeout_s=TIMEOUT):
    """Until the service reports an item being scored (so the next call overlaps it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(
            r"^posttrain_reward_items_in_flight (\S+)$", http.get("/metrics").text, re.MULTILINE
        )
        if m and float(m.group(1)) >= 1:
            return
        time.sleep(0.05)
    raise AssertionError("no item was ever in flight")


def _score(http, response, gold="5"):
    body = {"items": [{"uid": "u", "response": response, "ground_truth": gold}]}
    resp = http.post("/score", json=body)
    assert resp.status_code == 200
    return resp.json()["scores"][0]


def test_power_tower_times_out_and_health_answers_during_and_after(service):
    http, _ = service
    got = {}
    worker = threading.Thread(
        target=lambda: got.update(_score(http, HOSTILE_MATH["power_tower"])), daemon=True
    )
    worker.start()
    _wait_in_flight(http)
    assert http.get("/health").status_code == 200  # while the item is being scored
    worker.join(timeout=2 * TIMEOUT)
    assert not worker.is_alive(), "POST /score never returned"
    assert got["reward"] is None
    assert got["error"].startswith("correct: timed out after 2 s")
    assert http.get("/health").status_code == 200
    assert _score(http, "\\boxed{5}")["reward"] == 1.0  # a fresh worker took its place


@pytest.mark.parametrize("name", sorted(HOSTILE_MATH))
def test_hostile_math_comes_back_and_the_service_stays_healthy(service, name):
    http, _ = service
    s = _score(http, HOSTILE_MATH[name])
    assert s["reward"] == 0.0 or (s["reward"] is None and "correct: timed out" in s["error"]), s
    assert http.get("/health").status_code == 200
    assert _score(http, "The answer is 5.")["reward"] == 1.0


def test_an_equation_tower_against_an_equation_gold_comes_back(service):
    http, _ = service
    s = _score(http, r"\boxed{x^{9^{9^{9}}} + y = 0}", gold="3x+4y+14=0")
    assert s["reward"] == 0.0 or (s["reward"] is None and "correct: timed out" in s["error"]), s
    assert _score(http, r"\boxed{6x+8y+28=0}", gold="3x+4y+14=0")["reward"] == 1.0


# The field reports, scored through the service's bounded workers (tests/rewards/test_math.py
# has the reasons).
@pytest.mark.parametrize(
    ("response", "gold", "want"),
    [
        ("The answer is $1,234.", "1234", 1.0),
        ("The answer is $7.", "7", 1.0),
        (r"\boxed{3x-y+13=0}", "3x+4y+14=0", 0.0),
        ("The answer is \\boxed{42}.\n#### Check", "42", 1.0),
        ("The answer is \\boxed{42}.\n#### All 3 steps verified.", "42", 1.0),
    ],
)
def test_field_reported_answers_through_the_service(service, response, gold, want):
    http, _ = service
    assert _score(http, response, gold)["reward"] == want


def test_a_batch_of_hostile_items_fails_only_those_items(service):
    http, _ = service
    items = [
        {"uid": "bad", "response": HOSTILE_MATH["power_tower"], "ground_truth": "5"},
        {"uid": "good", "response": "\\boxed{5}", "ground_truth": "5"},
        {"uid": "bad2", "response": HOSTILE_MATH["huge_factorial"], "ground_truth": "5"},
        {"uid": "good2", "response": "#### 4", "ground_truth": "5"},
    ]
    scores = http.post("/score", json={"items": items}).json()["scores"]
    assert [s["reward"] for s in scores] == [None, 1.0, None, 0.0]


def test_catastrophic_format_regex_times_out(service):
    http, _ = service
    s = _score(http, "a" * 60 + "!")
    assert s["reward"] is None and s["error"].startswith("shape: timed out after 2 s"), s
    assert http.get("/health").status_code == 200


def test_runaway_python_function_times_out(service):
    http, _ = service
    s = _score(http, "spin")
    assert s["reward"] is None and s["error"].startswith("user: timed out after 2 s"), s
    assert _score(http, "\\boxed{5}")["reward"] == 1.0


def test_python_function_over_its_memory_limit_fails_its_item(service):
    http, _ = service
    s = _score(http, "hog")
    assert s["reward"] is None and "MemoryError" in s["error"], s
    assert _score(http, "\\boxed{5}")["reward"] == 1.0


def test_metrics_count_timeouts(service):
    http, _ = service
    _score(http, HOSTILE_MATH["double_exponent"])
    text = http.get("/metrics").text
    assert 'posttrain_reward_items_total{component="correct",outcome="timeout"}' in text


def test_sigterm_stops_the_service_while_it_scores_a_hostile_item(tmp_path):
    port = free_port()
    proc = start_local_service(json.dumps(COMPONENTS[:1]), port, "t", tmp_path / "log")
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT, headers={"Authorization": "Bearer t"}
    )
    try:
        _wait_healthy(http, proc)
        threading.Thread(target=_score_quietly, args=(http,), daemon=True).start()
        _wait_in_flight(http)
        proc.terminate()
        assert proc.wait(timeout=TIMEOUT) is not None
    finally:
        http.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _score_quietly(http):
    try:
        _score(http, HOSTILE_MATH["power_tower"])
    except (httpx.HTTPError, AssertionError):
        pass  # the service is being stopped under this request


def test_non_finite_results_fail_their_items_over_the_real_service(tmp_path):
    """NaN, inf and 1e400 from a python function (run in the bounded workers), and a
    NaN among its details, through the run's own service process and client: the
    non-finite rewards fail their items naming the component, the NaN detail comes
    back as text, and the batch's other items are scored."""
    from posttrain.rewards.client import RewardClient
    from posttrain.rewards.protocol import ScoreItem

    comps = [
        {"name": "user", "type": "python", "function": "tests.rewards.user_rewards:echo_number"}
    ]
    port = free_port()
    proc = start_local_service(json.dumps(comps), port, "t", tmp_path / "log", workers=1)
    client = RewardClient(f"http://127.0.0.1:{port}/score", token="t", retries=0)
    try:
        client.wait_ready(timeout_s=TIMEOUT, proc=proc)
        texts = ["nan", "inf", "1e400", "1e39", "details", "2"]
        scores = client.score([ScoreItem(uid=t, response=t) for t in texts])
    finally:
        client.close()
        proc.kill()
        proc.wait(timeout=30)
    for s in scores[:4]:
        assert s.reward is None and s.error.startswith("user: "), s
    assert scores[4].reward == 0.5 and scores[4].details["user.ratio"] == "nan"
    assert scores[5].reward == 2.0
