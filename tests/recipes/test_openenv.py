"""OpenEnv environments (`rollout.environment: {type: openenv}`): the example game
served in-process over OpenEnv's WebSocket and HTTP protocol, driven by a scripted
engine; token-exact trajectories with environment tokens masked; a hostile server whose
faults (raises, hangs, wrong types, huge observations, non-finite rewards, closing
mid-episode) fail only their own episodes."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from transformers import AutoTokenizer

from posttrain.actors.engine import Sample
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.config.episodes import OpenEnvEnvironment
from posttrain.recipes.episodes.environments import make_environment
from posttrain.recipes.episodes.multiturn import run_episodes, start_episodes, to_rollout
from posttrain.recipes.episodes.openenv import episode_seed
from posttrain.recipes.episodes.step import add_environment_rewards
from posttrain.rewards.protocol import Score
from tests.hostile_servers import serve_app
from tests.tiny_model import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import openenv_game  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("t") / "m"))


@pytest.fixture(scope="module")
def game():
    with serve_app(openenv_game.create_app()) as url:
        yield url


class Scripted:
    """Answers every running episode's k-th turn with `texts[k]` + `<|im_end|>`; keeps
    each call's prompts and samples (the engine's ids) to compare with the rollouts."""

    def __init__(self, tok, texts: list[str]):
        self.tok, self.texts, self.calls = tok, texts, []

    def __call__(self, prompts, sampling):
        eot = self.tok.convert_tokens_to_ids("<|im_end|>")
        ids = self.tok.encode(self.texts[len(self.calls)], add_special_tokens=False) + [eot]
        out = [
            Sample(list(ids), [-0.1 * (j + 1) for j in range(len(ids))], "stop") for _ in prompts
        ]
        self.calls.append((prompts, out))
        return out, 2


def _run(tok, cfg, group_ids, texts, max_turns=4):
    reqs = [PromptRequest(g, [{"role": "user", "content": "Guess my number."}]) for g in group_ids]
    eps = start_episodes(tok, reqs, 1, lambda uid: make_environment(cfg, f"{uid}@0"))
    engine = Scripted(tok, texts)
    run_episodes(engine, tok, eps, SamplingSettings(n=1, max_new_tokens=40), max_turns, 2000)
    for e in eps:
        e.env.close()
    return eps, engine


def _group_for(secret: int) -> str:
    """A group id whose episode seed makes the game's secret `secret`."""
    ids = (f"s0-p{i}-0" for i in range(10_000))
    return next(g for g in ids if episode_seed(g) % 100 + 1 == secret)


def test_every_evaluation_resets_the_same_games():
    """The seed ignores the step or policy version in the group id: before, the
    evaluations at versions 0 and 10 played different secret numbers."""
    assert episode_seed("e0-p3-3") == episode_seed("e10-p3-3") == episode_seed("e7-p3-3")
    assert episode_seed("e0-p3-3") != episode_seed("e0-p4-4")
    assert episode_seed("e0-p3-3") != episode_seed("s0-p3-3")  # training's own games


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_openenv_game_plays_to_the_end_token_exact(tok, game, transport):
    cfg = OpenEnvEnvironment(
        type="openenv", url=game, transport=transport, observation_key="feedback", retries=0
    )
    groups = [_group_for(37)] if transport == "http" else [_group_for(37), _group_for(90)]
    eps, engine = _run(tok, cfg, groups, ["I say 50", "hmm", "I say 37", "I say 38"])
    e = eps[0]  # 50 lower, no number, 37 right
    assert e.done and not e.truncated and e.error is None and e.env_reward == 1.0
    assert [t.role for t in e.turns] == ["assistant", "user", "assistant", "user", "assistant"]
    assert [t.text for t in e.turns[1::2]] == ["50 is wrong: go lower.", "Answer with one number."]
    # Trained ids: every model turn is the engine's sampled ids, exactly, mask 1; the
    # environment's tokens between them are masked; each turn was sampled from the
    # prompt and everything before it.
    r = to_rollout(e, "")
    model_turns = [t for t in e.turns if t.mask]
    for k, t in enumerate(model_turns):
        prompts, samples = engine.calls[k]
        assert t.ids == samples[0].token_ids and t.logprobs == samples[0].logprobs
        before = [i for u in e.turns[: e.turns.index(t)] for i in u.ids]
        assert prompts[0] == r.prompt_ids + before
    sampled = [i for t in model_turns for i in t.ids]
    assert [i for i, m in zip(r.response_ids, r.loss_mask, strict=True) if m] == sampled
    assert sum(1 - m for m in r.loss_mask) == sum(len(t.ids) for t in e.turns if not t.mask) > 0
    if transport == "websocket":  # the other game goes on: 50, -, 37, 38 all wrong
        assert eps[1].truncated and eps[1].env_reward == 0.0 and eps[1].model_turns == 4


def test_openenv_state_and_observation_prompt(tok, game):
    cfg = OpenEnvEnvironment(
        type="openenv", url=game, observation_key="prompt", prompt="observation", retries=0
    )
    env = make_environment(cfg, "x-0@1")
    try:
        req = PromptRequest(
            "x", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "?"}]
        )
        messages = env.reset(req)
        assert messages == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": openenv_game.PROMPT},
        ]
        env.step("7")
        assert env.state() == {"episode_id": "x-0@1", "step_count": 1}
    finally:
        env.close()


# --- a hostile OpenEnv server ------------------------------------------------------


def hostile_app():
    """An OpenEnv server whose episode misbehaves as its id (the group id) says, at its
    first step; `fine` plays a normal episode that ends with reward 1."""
    app = FastAPI()

    def obs(**kw):
        return {"type": "observation", "data": {"observation": {"text": "ok"}, **kw}}

    @app.websocket("/ws")
    async def session(ws: WebSocket) -> None:
        await ws.accept()
        kind = ""
        try:
            while True:
                msg = json.loads(await ws.receive_text())
                if msg["type"] == "reset":
                    kind = msg["data"]["episode_id"].split("-")[0]
                    await ws.send_text(json.dumps(obs()))
                    continue
                if msg["type"] != "step":
                    break
                if kind == "raises":
                    out = {"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}}
                elif kind == "hangs":
                    await asyncio.sleep(1.5)
                    out = obs(done=True)
                elif kind == "wrongtypes":
                    out = {"type": "observation", "data": {"observation": "x", "reward": "high"}}
                elif kind == "huge":
                    out = {"type": "observation", "data": {"observation": {"text": "x" * 200_000}}}
                elif kind == "nan":
                    await ws.send_text(
                        '{"type": "observation", "data": {"observation": '
                        '{"text": "ok"}, "reward": NaN, "done": true}}'
                    )
                    continue
                elif kind == "closes":
                    await ws.close()
                    return
                else:
                    out = obs(reward=1.0, done=True)
                await ws.send_text(json.dumps(out))
        except WebSocketDisconnect:
            return

    return app


def test_a_faulty_openenv_server_fails_only_its_episodes(tok):
    faults = ["raises", "hangs", "wrongtypes", "huge", "nan", "closes"]
    with serve_app(hostile_app()) as url:
        cfg = OpenEnvEnvironment(
            type="openenv",
            url=url,
            observation_key="text",
            timeout_s=0.5,
            retries=0,
            max_message_bytes=100_000,
        )
        eps, _ = _run(tok, cfg, ["fine", *faults], ["a guess", "again"], max_turns=2)
    fine, *bad = eps
    assert fine.error is None and fine.env_reward == 1.0 and fine.done
    rollouts = [to_rollout(e, "") for e in eps]
    scores = add_environment_rewards(rollouts, [Score(uid=r.uid, reward=0.0) for r in rollouts])
    assert scores[0].reward == 1.0
    why = {"raises": "boom", "hangs": "timeout_s", "wrongtypes": "high", "huge": "1009",
           "nan": "finite", "closes": "connection"}  # fmt: skip
    for fault, e, r, s in zip(faults, bad, rollouts[1:], scores[1:], strict=True):
        assert e.done and s.reward is None, (fault, s)
        assert f"{fault}-0@0" in s.error and why[fault] in s.error, (fault, s.error)
        assert r.response_ids == e.turns[0].ids and r.loss_mask == [1] * len(r.response_ids)
