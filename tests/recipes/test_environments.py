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
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.common.net import free_port
from posttrain.config.episodes import HttpEnvironment, PythonEnvironment
from posttrain.recipes.episodes.environments import EnvironmentFailed, make_environment
from posttrain.recipes.episodes.multiturn import run_episodes, start_episodes, to_rollout
from posttrain.recipes.episodes.step import add_environment_rewards
from posttrain.rewards.protocol import Score
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
    with pytest.raises(EnvironmentFailed, match="401"):
        _play(tok, lambda uid: make_environment(cfg, uid), "37")
    assert time.monotonic() - t0 < 5  # a 401 is not retried (3 retries would back off 3.5 s)


def test_unreachable_environment_fails_after_retries(tok):
    cfg = HttpEnvironment(type="http", url=f"http://127.0.0.1:{free_port()}", retries=1)
    with pytest.raises(EnvironmentFailed, match="ConnectError"):
        _play(tok, lambda uid: make_environment(cfg, uid), "37")


def test_python_class_environment(tok):
    cfg = PythonEnvironment(type="python", class_path="guess_env:GuessingGame")
    e = _play(tok, lambda uid: make_environment(cfg, uid), "90", max_turns=3)
    # 50, 75, 88: not found in three turns: truncated, no reward.
    assert e.truncated and e.model_turns == 3 and e.env_reward == 0.0
    bad = PythonEnvironment(type="python", class_path="guess_env:Nope")
    with pytest.raises(EnvironmentFailed, match="cannot be imported"):
        make_environment(bad, "x")
