"""Verifiers environments (`rollout.environment: {type: verifiers}`): the example
calculator game (examples/vf_calc_game.py, written to verifiers' MultiTurnEnv API)
loaded through a local stand-in of the verifiers package (tests/stand_ins), its dataset
as prompts, its turns token-exact with environment tokens masked, its rubric functions
as reward components; what posttrain cannot run is refused naming it; a failing
environment fails only its episode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from posttrain.actors.engine import Sample
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.config import RecipeError
from posttrain.config.episodes import VerifiersEnvironment
from posttrain.recipes.data.environment import check_contract, environment_items
from posttrain.recipes.episodes.environments import make_environment
from posttrain.recipes.episodes.multiturn import (
    finish_episodes,
    run_episodes,
    start_episodes,
    to_rollout,
)
from posttrain.recipes.episodes.step import add_environment_rewards
from posttrain.rewards.protocol import Score
from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
CFG = VerifiersEnvironment(type="verifiers", module="vf_calc_game", args={"size": 4})


@pytest.fixture(autouse=True)
def paths(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "stand_ins"))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("t") / "m", max_positions=1024)
    return AutoTokenizer.from_pretrained(folder)


class Scripted:
    """Turn k of every running episode is `script[group][k]` + `<|im_end|>`."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def __call__(self, prompts, sampling):
        eot = self.tok.convert_tokens_to_ids("<|im_end|>")
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            group = next(g for g in self.script if f"[{g}]" in text)
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.tok.encode(self.script[group][turn], add_special_tokens=False) + [eot]
            out.append(Sample(ids, [-0.05 * (j + 1) for j in range(len(ids))], "stop"))
        self.calls.append((prompts, out))
        return out, 4


def _episodes(tok, cfg, items, script, max_turns=3):
    reqs = [
        PromptRequest(
            g,
            [*i.messages[:-1], {"role": "user", "content": f"[{g}] {i.question}"}],
            i.ground_truth,
            i.metadata,
        )  # fmt: skip
        for g, i in zip(script, items, strict=False)
    ]
    eps = start_episodes(tok, reqs, 1, lambda uid: make_environment(cfg, f"{uid}@0"))
    engine = Scripted(tok, script)
    run_episodes(engine, tok, eps, SamplingSettings(n=1, max_new_tokens=60), max_turns, 2000)
    finish_episodes(eps)
    return eps, engine


def test_the_dataset_is_the_prompts():
    items = environment_items(CFG, "train", "data.train", 3, None)
    assert len(items) == 3 and items[0].metadata["data_source"] == "verifiers:vf_calc_game"
    assert items[0].messages[0]["role"] == "system" and "calc:" in items[0].messages[0]["content"]
    a, op, b = items[0].question.removeprefix("What is ").rstrip("?").split()
    assert items[0].ground_truth == str(eval(f"{a}{op}{b}"))
    held = environment_items(CFG, "eval", "eval.prompts", None, None)
    assert len(held) == 50 and {i.question for i in held}.isdisjoint(i.question for i in items)


def test_episode_runs_the_game_token_exact_and_scores_each_rubric_function(tok):
    items = environment_items(CFG, "train", "data.train", 2, None)
    right = items[0].ground_truth
    script = {
        "a": ["calc: 6*7", f"answer: {right}"],  # the tool, then the right answer
        "b": ["hmm", "no idea", "still no"],  # never answers: the game's max_turns ends it
    }
    eps, engine = _episodes(tok, CFG, items, script)
    a, b = eps
    assert [t.role for t in a.turns] == ["assistant", "user", "assistant"]
    assert a.turns[1].text == "result: 42" and a.error is None
    assert a.components == {"correct": 1.0, "answered": 1.0} and a.env_reward == 1.2
    assert b.model_turns == 3 and b.components == {"correct": 0.0, "answered": 0.0}
    assert b.env_reward == 0
    r = to_rollout(a, "")
    for k, t in enumerate([t for t in a.turns if t.mask]):  # the engine's ids, exactly
        prompts, samples = engine.calls[k]
        assert t.ids == samples[0].token_ids and t.logprobs == samples[0].logprobs
        assert prompts[0] == r.prompt_ids + [i for u in a.turns[: a.turns.index(t)] for i in u.ids]
    assert r.loss_mask == [1] * len(a.turns[0].ids) + [0] * len(a.turns[1].ids) + [1] * len(
        a.turns[2].ids
    )
    (s,) = add_environment_rewards([r], [Score(uid=r.uid, reward=0.0)])
    assert s.reward == 1.2 and s.details["correct"] == 1.0 and s.details["answered"] == 1.0


class V1Env:
    """What verifiers 0.4 (verifiers.v1) gives: a taskset and a harness, no env_response."""

    taskset, harness = object(), object()


class ToolsEnv:
    async def env_response(self, messages, state): ...
    async def is_completed(self, state): ...

    oai_tools = [{"type": "function", "function": {"name": "calc"}}]


def group_reward(completions, answers): ...


class GroupEnv(ToolsEnv):
    oai_tools = None
    rubric = type("R", (), {"funcs": [group_reward], "weights": [1.0]})()


@pytest.mark.parametrize(
    "env, says",
    [(V1Env(), "no env_response"), (ToolsEnv(), "oai_tools"), (GroupEnv(), "group_reward")],
)
def test_what_posttrain_cannot_run_is_refused_naming_it(env, says):
    with pytest.raises(RecipeError, match=says):
        check_contract(env, "rollout.environment (x)")


def test_a_missing_module_is_refused_at_load():
    cfg = VerifiersEnvironment(type="verifiers", module="no_such_env_module")
    with pytest.raises(RecipeError, match="no_such_env_module"):
        environment_items(cfg, "train", "data.train", None, None)


def test_a_failing_or_hanging_env_response_fails_only_its_episode(tok, monkeypatch):
    import vf_calc_game

    async def env_response(self, messages, state, **kw):
        if "[boom]" in messages[1]["content"]:
            raise RuntimeError("env exploded")
        if "[slow]" in messages[1]["content"]:
            await asyncio.sleep(5)
        return [{"role": "user", "content": "go on"}]

    monkeypatch.setattr(vf_calc_game.CalcGame, "env_response", env_response)
    cfg = VerifiersEnvironment(type="verifiers", module="vf_calc_game", args={"size": 5},
                               timeout_s=0.3)  # fmt: skip
    items = environment_items(cfg, "train", "data.train", 3, None)
    script = {"fine": ["x", "answer: 1"], "boom": ["x"], "slow": ["x"]}
    fine, boom, slow = _episodes(tok, cfg, items, script, max_turns=2)[0]
    assert fine.error is None and fine.components["answered"] == 1.0
    assert "boom-0" in boom.error and "env exploded" in boom.error and boom.model_turns == 1
    assert "slow-0" in slow.error and "TimeoutError" in slow.error


@pytest.mark.parametrize(
    "text, stated",
    [
        ("answer: 19", "19"),
        ("The answer is 19.", "19"),
        ("**Answer:** 19", "19"),
        ("12 + 7 = 19", "19"),
        ("7+12=19", "19"),
        ("19.", "19"),
        ("12 + 7 = 20, so 12 + 7 = 19", "19"),  # the last statement is judged
        ("answer: -5", "-5"),
        ("3 + 4 = 7", None),  # not the question's equation
        ("To add 12 and 7 we get 19 or 20", None),  # numbers in prose are not an answer
        ("calc: 12+7", None),
    ],
)
def test_the_game_judges_the_answer_a_turn_states_and_nothing_else(text, stated):
    import vf_calc_game

    assert vf_calc_game.stated_answer(text, "What is 12 + 7?") == stated
    prompt = [{"role": "user", "content": "What is 12 + 7?"}]
    completion = [{"role": "assistant", "content": text}]
    assert vf_calc_game.correct(prompt, completion, "19") == float(stated == "19")
    assert vf_calc_game.answered(prompt, completion) == float(stated is not None)


def test_held_out_problems_are_never_trained_on():
    import vf_calc_game

    train, held = vf_calc_game.problems(400, 100, 0, 20, "+")
    assert len(train) == 400 and len({r["question"] for r in held}) == 100
    assert {r["question"] for r in train}.isdisjoint(r["question"] for r in held)
    with pytest.raises(ValueError, match="eval_size"):
        vf_calc_game.problems(4, 400, 0, 20, "+")
