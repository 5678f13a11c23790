"""Users' environments: the example guessing game over HTTP (bearer token) and as a
Python class, driven by a scripted engine through whole episodes."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from transformers import AutoTokenizer

from posttrain.actors.engine import Sample
from posttrain.actors.rollout import PromptRequest, Rollout, SamplingSettings
from posttrain.common.net import free_port
from posttrain.config.episodes import HttpEnvironment, PythonEnvironment
from posttrain.recipes.episodes.environments import EnvironmentFailed, make_environment
from posttrain.recipes.episodes.multiturn import run_episodes, start_episodes, to_rollout
from posttrain.recipes.episodes.step import add_environment_rewards
from posttrain.rewards.protocol import Score
from tests.hostile_servers import SlowDrip
from tests.tiny_model import build_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import guess_env  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("t") / "m"))


@pytest.fixture(scope="module")
def server():
    port = free_port()
    srv = uvicorn.Server(
        uvicorn.Config(
            guess_env.create_app("s3cret"), host="127.0.0.1", port=port, log_level="error"
        )
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        try:
            httpx.post(f"http://127.0.0.1:{port}/step", json={})
            break
        except httpx.TransportError:
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


class Bisect:
    """A scripted 'model' that bisects [1, 100] from the game's hints."""

    def __init__(self, tok):
        self.tok, self.bounds = tok, {}

    def __call__(self, prompts, sampling):
        out = []
        eot = self.tok.convert_tokens_to_ids("<|im_end|>")
        for p in prompts:
            key = tuple(p[:12])  # the episode's prompt identifies it
            lo, hi = self.bounds.get(key, (1, 100))
            text = self.tok.decode(p)
            if "go higher" in text.rsplit("user", 1)[-1]:
                lo = self.last[key] + 1
            elif "go lower" in text.rsplit("user", 1)[-1]:
                hi = self.last[key] - 1
            guess = (lo + hi) // 2
            self.bounds[key], self.last = (lo, hi), {**getattr(self, "last", {}), key: guess}
            ids = self.tok.encode(f"My guess: {guess}", add_special_tokens=False) + [eot]
            out.append(Sample(ids, [-0.5] * len(ids), "stop"))
        return out, 0


def _play(tok, new_env, secret: str, max_turns: int = 8):
    req = PromptRequest(
        "g0", [{"role": "user", "content": f"Guess my number ({secret})."}], ground_truth=secret
    )
    eps = start_episodes(tok, [req], 1, new_env)
    run_episodes(Bisect(tok), tok, eps, SamplingSettings(n=1, max_new_tokens=40), max_turns, 2000)
    return eps[0]


def test_http_environment_plays_to_the_end(tok, server, monkeypatch):
    monkeypatch.setenv("GUESS_TOKEN", "s3cret")
    cfg = HttpEnvironment(type="http", url=server, token_env="GUESS_TOKEN", retries=0)
    e = _play(tok, lambda uid: make_environment(cfg, f"{uid}@0"), "37")
    assert e.done and not e.truncated and e.env_reward == 1.0
    # 50 lower, 25 higher, 37: three model turns, two environment messages.
    assert [t.role for t in e.turns] == ["assistant", "user", "assistant", "user", "assistant"]
    assert "50 is wrong: go lower." in e.turns[1].text
    r = to_rollout(e, "")
    assert r.metadata["environment_reward"] == 1.0
    (s,) = add_environment_rewards([r], [Score(uid=r.uid, reward=0.5)])
    assert s.reward == 1.5 and s.details["environment"] == 1.0


def test_http_environment_refuses_a_bad_token(tok, server, monkeypatch):
    monkeypatch.setenv("GUESS_TOKEN", "wrong")
    cfg = HttpEnvironment(type="http", url=server, token_env="GUESS_TOKEN", retries=3)
    t0 = time.monotonic()
    e = _play(tok, lambda uid: make_environment(cfg, uid), "37")
    assert e.done and not e.turns and "401" in e.error and "at reset" in e.error, e.error
    assert time.monotonic() - t0 < 5  # a 401 is not retried (3 retries would back off 3.5 s)


def test_unreachable_environment_fails_its_episode_after_retries(tok):
    cfg = HttpEnvironment(type="http", url=f"http://127.0.0.1:{free_port()}", retries=1)
    e = _play(tok, lambda uid: make_environment(cfg, uid), "37")
    assert e.done and "ConnectError" in e.error and "g0-0" in e.error, e.error


def test_python_class_environment(tok):
    cfg = PythonEnvironment(type="python", class_path="guess_env:GuessingGame")
    e = _play(tok, lambda uid: make_environment(cfg, uid), "90", max_turns=3)
    # 50, 75, 88: not found in three turns: truncated, no reward.
    assert e.truncated and e.model_turns == 3 and e.env_reward == 0.0
    bad = PythonEnvironment(type="python", class_path="guess_env:Nope")
    with pytest.raises(EnvironmentFailed, match="cannot be imported"):
        make_environment(bad, "x")


# --- hostile environments ------------------------------------------------------------

NON_FINITE = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "1e39",
    "-3.5e38",
]  # the last two: inf in float32


def _step_body(reward: str) -> str:
    """A reply that serves as both /reset and /step: one user message, the reward, done."""
    return (
        '{"messages": [{"role": "user", "content": "Guess."}], '
        f'"reward": {reward}, "done": true}}'
    )


@pytest.mark.parametrize("literal", NON_FINITE)
def test_http_environment_non_finite_reward_fails_that_sample(tok, literal):
    with SlowDrip(_step_body(literal), interval_s=0) as url:
        cfg = HttpEnvironment(type="http", url=url, retries=0)
        e = _play(tok, lambda uid: make_environment(cfg, f"{uid}@3"), "37")
    assert e.done and e.env_reward is None
    r = to_rollout(e, "")
    (s,) = add_environment_rewards([r], [Score(uid=r.uid, reward=0.5)])
    assert s.reward is None, s
    assert "g0-0@3" in s.error and url in s.error and "finite" in s.error, s.error


class NonFiniteGame:
    """A Python environment whose step rewards are 3e38 twice (each finite in float32,
    their sum not)."""

    def reset(self, request):
        return list(request.messages)

    def step(self, message):
        return {"messages": [{"role": "user", "content": "again"}], "reward": 3e38}


def test_python_environment_reward_sum_overflow_fails_that_sample(tok):
    cfg = PythonEnvironment(
        type="python", class_path="tests.recipes.test_environments:NonFiniteGame"
    )
    e = _play(tok, lambda uid: make_environment(cfg, uid), "37", max_turns=3)
    r = to_rollout(e, "")
    (s,) = add_environment_rewards([r], [Score(uid=r.uid, reward=0.0)])
    assert s.reward is None and "NonFiniteGame" in s.error and "sum to 6e+38" in s.error, s


def test_agent_sum_that_overflows_fails_the_sample():
    r = Rollout("u-0", "u", [1], [2], [-0.1], "stop", 0, "", "", metadata={})
    r.metadata["environment_reward"] = 1e308
    (s,) = add_environment_rewards([r], [Score(uid="u-0", reward=1e308)])
    assert s.reward is None and "u-0" in s.error


@pytest.mark.parametrize("drip_headers", [False, True], ids=["body", "headers"])
def test_slow_drip_environment_is_cut_at_the_deadline(tok, drip_headers):
    timeout_s = 1.0
    with SlowDrip(_step_body("1.0"), drip_headers=drip_headers) as url:
        cfg = HttpEnvironment(type="http", url=url, retries=0, timeout_s=timeout_s)
        t0 = time.monotonic()
        e = _play(tok, lambda uid: make_environment(cfg, uid), "37")
        assert e.done and "timeout_s" in e.error, e.error  # the episode fails, not the run
        took = time.monotonic() - t0
    assert took < 3 * timeout_s, took


class HugeReset:
    """`reset` hands back a 1M-token prompt (the tiny tokenizer: a token per character)
    for the prompt that asks for it, the item's own messages otherwise."""

    def reset(self, request):
        if "huge" in request.messages[-1]["content"]:
            return [{"role": "user", "content": "x" * 1_000_000}]
        return list(request.messages)

    def step(self, message):
        return {"done": True, "reward": 1.0}


def test_a_one_million_token_reset_fails_its_episode_not_the_run(tok):
    cfg = PythonEnvironment(type="python", class_path="tests.recipes.test_environments:HugeReset")
    requests = [
        PromptRequest("big", [{"role": "user", "content": "huge please"}]),
        PromptRequest("small", [{"role": "user", "content": "small please"}]),
    ]
    eps = start_episodes(
        tok, requests, 1, lambda uid: make_environment(cfg, uid), 400, "the test's limit"
    )
    seen: list[int] = []

    def engine(prompts, sampling):
        seen.extend(len(p) for p in prompts)
        eot = tok.convert_tokens_to_ids("<|im_end|>")
        return [Sample([eot], [-0.1], "stop") for _ in prompts], 5

    run_episodes(engine, tok, eps, SamplingSettings(n=1, max_new_tokens=8), 2, 100)
    assert seen and max(seen) <= 400  # the 1M-token prompt never reached the engine
    big, small = (to_rollout(e, "", 5) for e in eps)
    assert big.response_ids == [] and len(big.prompt_ids) <= 400 and big.policy_version == 5
    assert "episode big-0" in big.metadata["episode_error"]
    assert "1000" in big.metadata["episode_error"] and "400" in big.metadata["episode_error"]
    scores = add_environment_rewards(
        [big, small], [Score(uid=x.uid, reward=0.0) for x in (big, small)]
    )
    assert scores[0].reward is None and "big-0" in scores[0].error
    assert scores[1].reward == 1.0  # the other episode ran and was scored


def test_engine_context_is_the_vllm_limit_or_the_models(tmp_path):
    from posttrain.config import Recipe
    from posttrain.recipes.episodes.step import engine_context

    folder = build_tiny_model(tmp_path / "m", max_positions=640)

    def recipe(engine: str, max_model_len: int | None) -> Recipe:
        return Recipe.model_validate(
            {
                "name": "ctx",
                "algorithm": "grpo",
                "model": {"path": str(folder)},
                "data": {"train": {"generator": "arithmetic", "size": 4}},
                "rollout": {"engine": engine, "vllm": {"max_model_len": max_model_len}},
                "rewards": [{"name": "correct", "type": "math"}],
                "train": {"steps": 1, "prompts_per_step": 2},
            }
        )

    n, where = engine_context(recipe("hf", None), str(folder))
    assert n == 640 and "config.json" in where
    n, where = engine_context(recipe("vllm", 600), str(folder))
    assert n == 600 and "rollout.vllm.max_model_len" in where


class Faulty:
    """A Python environment that fails as its prompt says: `raise` at its first step,
    `badreset` (reset gives a string), `badstep` (step gives messages of the wrong
    type); otherwise it ends the episode with reward 1."""

    def reset(self, request):
        self.kind = request.messages[-1]["content"]
        return "not a list" if self.kind == "badreset" else list(request.messages)

    def step(self, message):
        if self.kind == "raise":
            raise KeyError("state lost")
        if self.kind == "badstep":
            return {"messages": [{"role": "user", "content": 7}], "done": False}
        return {"reward": 1.0, "done": True}


def test_a_faulty_python_environment_fails_only_its_episode(tok):
    from posttrain.recipes.episodes.step import episode_metrics

    cfg = PythonEnvironment(type="python", class_path="tests.recipes.test_environments:Faulty")
    kinds = ["fine", "raise", "badreset", "badstep"]
    requests = [PromptRequest(k, [{"role": "user", "content": k}]) for k in kinds]
    eps = start_episodes(tok, requests, 1, lambda uid: make_environment(cfg, uid))
    run_episodes(Bisect(tok), tok, eps, SamplingSettings(n=1, max_new_tokens=40), 3, 2000)
    fine, raised, badreset, badstep = eps
    assert fine.error is None and fine.env_reward == 1.0
    assert (
        "raise-0" in raised.error and "KeyError" in raised.error and "model turn 1" in raised.error
    )
    assert raised.model_turns == 1  # the sampled turn is kept
    assert "badreset-0" in badreset.error and "at reset" in badreset.error and not badreset.turns
    assert "badstep-0" in badstep.error and "Faulty.step" in badstep.error
    assert episode_metrics(eps)["episode/environment_errors"] == 3.0


def test_an_http_answer_over_max_message_bytes_fails_its_episode(tok):
    huge = '{"messages": [{"role": "user", "content": "' + "x" * 300_000 + '"}]}'
    with SlowDrip(huge, interval_s=0) as url:
        cfg = HttpEnvironment(type="http", url=url, retries=2, max_message_bytes=100_000)
        e = _play(tok, lambda uid: make_environment(cfg, uid), "37")
    assert e.done and not e.turns and "max_message_bytes 100,000" in e.error, e.error
