"""Parity of multi-turn trajectories on both engines: after a weight push, the learner's
logprobs of the whole packed trajectory (prompt, model turns, environment messages
between them) reproduce the engine's `inference_logprobs` on every model token (fp32,
atol 1e-4), and the train batch masks exactly the environment tokens; with a Python
environment, an OpenEnv server (the example game, over WebSocket) and a verifiers
environment (the example calculator game)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.config.episodes import OpenEnvEnvironment, VerifiersEnvironment
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.recipes.algo.rollouts import rollout_batch
from posttrain.recipes.episodes.environments import make_environment
from posttrain.recipes.episodes.multiturn import (
    StepResult,
    run_episodes,
    start_episodes,
    to_rollout,
)
from tests.engine_host import RemoteEngine, requires_vllm
from tests.hostile_servers import serve_app
from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import openenv_game  # noqa: E402

KINDS = [
    ("hf", "python"),
    ("hf", "openenv"),
    ("hf", "verifiers"),
    pytest.param("vllm", "python", marks=[pytest.mark.vllm, requires_vllm]),
]
TEMPERATURE = 0.7
# Turns end on any of these characters (stop strings), so most turns end well before
# max_new_tokens and episodes run several turns even with random weights.
STOPS = tuple("aeiou0123456789")


class Feedback:
    """An environment that always answers with a user message naming the turn."""

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, request: PromptRequest) -> list[dict[str, str]]:
        return list(request.messages)

    def step(self, message: str) -> StepResult:
        self.turn += 1
        return StepResult(messages=[{"role": "user", "content": f"turn {self.turn}: more"}])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    start = build_tiny_model(root / "start", hidden=128, max_positions=1024, seed=0)
    pushed = build_tiny_model(root / "pushed", hidden=128, max_positions=1024, seed=1)
    return start, pushed


@pytest.mark.parametrize("kind, env", KINDS)
def test_learner_reproduces_multi_turn_inference_logprobs(
    kind, env, ray_local, folders, monkeypatch
):
    start, pushed = folders
    if env == "openenv":
        with serve_app(openenv_game.create_app()) as url:
            cfg = OpenEnvEnvironment(type="openenv", url=url, observation_key="feedback")
            _check_parity(kind, start, pushed, lambda uid: make_environment(cfg, uid))
    elif env == "verifiers":
        monkeypatch.syspath_prepend(str(ROOT / "tests" / "stand_ins"))  # verifiers' shape
        cfg = VerifiersEnvironment(type="verifiers", module="vf_calc_game", args={"size": 2})
        _check_parity(kind, start, pushed, lambda uid: make_environment(cfg, uid))
    else:
        _check_parity(kind, start, pushed, lambda uid: Feedback())


def _check_parity(kind, start, pushed, new_env):
    engine = RemoteEngine(EngineSettings(kind=kind, model_path=str(start), dtype="float32"))
    try:
        learner = AutoModelForCausalLM.from_pretrained(pushed, dtype=torch.float32).eval()
        engine.load_weights(list(learner.state_dict().items()))  # the push
        tok = AutoTokenizer.from_pretrained(start)
        reqs = [
            PromptRequest(f"g{i}", [{"role": "user", "content": q}])
            for i, q in enumerate(["7+8", "12*3"])
        ]
        episodes = start_episodes(tok, reqs, 2, new_env)
        sampling = SamplingSettings(
            n=1, max_new_tokens=24, temperature=TEMPERATURE, seed=4, stop=STOPS
        )

        def generate(prompts, s):
            return [g[0] for g in engine.generate(prompts, s)], 1

        run_episodes(generate, tok, episodes, sampling, max_turns=3, max_episode_tokens=400)
        assert not [e.error for e in episodes if e.error]
        rollouts = [to_rollout(e, "") for e in episodes]
        assert sum(e.model_turns for e in episodes) >= 8  # not vacuous: multi-turn happened
        batch = rollout_batch(rollouts, [1.0] * len(rollouts), pad_id=tok.pad_token_id)
        with torch.no_grad():
            lp = sequence_logprobs(
                learner, batch.input_ids, batch.attention_mask, batch.response_start, TEMPERATURE
            )
        m = batch.response_mask.bool()
        assert int(m.sum()) == sum(sum(r.loss_mask) for r in rollouts)
        env_tokens = sum(len(r.loss_mask) - sum(r.loss_mask) for r in rollouts)
        assert env_tokens > 0
        torch.testing.assert_close(lp[m], batch.inference_logprobs[m], rtol=0, atol=1e-4)
        # Against the weights before the push the logprobs differ: the push took effect.
        before = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).eval()
        with torch.no_grad():
            old = sequence_logprobs(
                before, batch.input_ids, batch.attention_mask, batch.response_start, TEMPERATURE
            )
        assert (old[m] - batch.inference_logprobs[m]).abs().max() > 0.1
    finally:
        engine.kill()
