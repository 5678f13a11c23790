"""verifiers 0.4 (`verifiers.v1`) environments (`rollout.environment: {type: verifiers,
api: v1}`): the example taskset (examples/vf1_sums.py, written to verifiers.v1's public
API) run by the driver in a subprocess through the local stand-in of verifiers.v1
(tests/stand_ins; the real package: test_vf1_real.py), its harness's streamed calls
served by an in-process rollout worker. The ids trained on are the engine's sampled ids,
the learner reproduces their logprobs, each `@vf.reward` is a reward component, and what
posttrain cannot serve is refused at validate, naming it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.rollout import PromptRequest
from posttrain.config import Recipe, RecipeError
from posttrain.config.episodes import VerifiersEnvironment
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.recipes.algo.rollouts import rollout_batch
from posttrain.recipes.data.environment import environment_items
from posttrain.recipes.episodes.agent_step import generate_agent_episodes
from posttrain.recipes.episodes.step import add_environment_rewards
from posttrain.rewards.protocol import Score

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    "type": "verifiers",
    "api": "v1",
    "module": "vf1_sums",
    "args": {"num_tasks": 3},
    "harness": {"id": "null"},
    "python": sys.executable,
}


@pytest.fixture(autouse=True)
def driver_path(monkeypatch):
    """The driver subprocess finds the example taskset and the stand-in verifiers (each
    step here starts and stops its own driver: no run's drivers are given)."""
    paths = [str(ROOT / "examples"), str(ROOT / "tests" / "stand_ins")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))


def _recipe(model: str, **env) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "vf1",
            "algorithm": "grpo",
            "model": {"path": model},
            "data": {"train": {"environment": "train"}},
            "rollout": {
                "engine": "hf",
                "samples_per_prompt": 2,
                "max_new_tokens": 6,
                "temperature": 0.9,
                "environment": ENV | env,
            },
            "rewards": [{"name": "none", "type": "length", "target_chars": 1, "weight": 0.0}],
            "train": {"steps": 1, "prompts_per_step": 2},
        }
    )


@pytest.fixture(scope="module")
def worker(hf_worker):
    return hf_worker


def test_v1_episodes_train_on_the_engines_sampled_ids(worker, tmp_path):
    w, folder = worker
    recipe = _recipe(str(folder))
    items = environment_items(recipe.rollout.environment, "train", "data.train", 2, None)
    assert [i.question for i in items] == [
        "What is 13 + 14? Reply with the number only.",
        "What is 2 + 9? Reply with the number only.",
    ]
    reqs = [
        PromptRequest(f"s0-p{i.prompt_id}-{k}", i.messages, "", i.metadata)
        for k, i in enumerate(items)
    ]
    records = {}

    def call(worker_, verb, *args):  # keep what the engine sampled for each episode
        got = getattr(worker_, verb)(*args)
        if verb == "pop_episode":
            records[args[0]] = got
        return got

    tok = w.engine.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rollouts, metrics = generate_agent_episodes([w], reqs, recipe, decode, tmp_path, 0, call=call)
    assert len(rollouts) == 4 and metrics["episode/agent_rewards"] == 4.0
    # the null harness's chat program ran in the driver: no program prepared or started
    assert "stand-in runtime:" not in (tmp_path / "agent_00000.log").read_text()
    for r in rollouts:
        calls = records[r.uid]["calls"]
        assert len(calls) == 1  # the null harness: one streamed chat call per task
        sampled = [t for c in calls for t in c["completion_ids"]]
        assert [t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if m] == sampled
        assert r.prompt_ids == calls[0]["prompt_ids"]
        assert r.inference_logprobs == [lp for c in calls for lp in c["logprobs"]]
        answer = 27 if "-p0-" in r.uid else 11
        numbers = re.findall(r"-?\d+", r.response_text)
        correct = float(bool(numbers) and int(numbers[-1]) == answer)
        short = float(len(r.response_text.strip()) <= 40)
        assert r.metadata["environment_components"] == {"correct": correct, "short": short}
        assert r.metadata["environment_reward"] == pytest.approx(correct + 0.1 * short, abs=1e-12)
    scores = add_environment_rewards(rollouts, [Score(uid=r.uid, reward=0.0) for r in rollouts])
    assert all(set(s.details) == {"correct", "short", "environment"} for s in scores)
    batch = rollout_batch(rollouts, [1.0] * 4, pad_id=tok.pad_token_id)
    learner = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = sequence_logprobs(
            learner, batch.input_ids, batch.attention_mask, batch.response_start, 0.9
        )
    m = batch.response_mask.bool()
    torch.testing.assert_close(lp[m], batch.inference_logprobs[m], rtol=0, atol=1e-4)


def _items(**env):
    cfg = VerifiersEnvironment.model_validate(ENV | env)
    return environment_items(cfg, "train", "data.train", None, None)


def test_validate_refuses_what_posttrain_cannot_serve(monkeypatch):
    with pytest.raises(RecipeError, match="harness 'bash'.*harness: {id: 'null'}"):
        _items(harness={"id": "bash"})
    with pytest.raises(RecipeError, match="does not exist"):
        _items(python="/nonexistent/bin/python")
    with pytest.raises(RecipeError, match="no eval split"):
        cfg = VerifiersEnvironment.model_validate(ENV)
        environment_items(cfg, "eval", "eval.prompts", None, None)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "examples"))  # no verifiers at all
    with pytest.raises(RecipeError, match=r"without verifiers\.v1 \(verifiers >= 0\.4\)"):
        _items()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": "ppo"}, "algorithm ppo is not supported"),
        ({"rollout.max_turns": 3}, "remove rollout.max_turns"),
        ({"rollout.environment.api": "classic"}, "python is a key of api: v1"),
        ({"data.train": {"generator": "arithmetic", "size": 4}}, "data.train: .*own taskset"),
        ({"eval": {"prompts": {"environment": "eval"}, "every_steps": 1}}, "eval.prompts: rollout"),
    ],
)
def test_recipe_refusals(change, message):
    raw = _recipe("m").model_dump(exclude_unset=True)
    for dotted, value in change.items():
        *path, last = dotted.split(".")
        node = raw
        for p in path:
            node = node[p]
        node[last] = value
    with pytest.raises(ValueError, match=message):
        Recipe.model_validate(raw)


def test_the_example_recipe_validates():
    from typer.testing import CliRunner

    from posttrain.recipes.cli import app

    got = CliRunner().invoke(app, ["validate", str(ROOT / "examples" / "vf1_sums.yaml")])
    assert got.exit_code == 0 and "ok:" in got.output and "97 prompts" in got.output, got.output


TOOLED = """
import verifiers.v1 as vf
from vf1_sums import SumsTaskset

__all__ = ["ToolTaskset"]


class CalcToolset:
    pass


class ToolTaskset(SumsTaskset):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset()]
"""

TWO_SEATS = """
import verifiers.v1 as vf
from vf1_sums import SumsTaskset

__all__ = ["PairTaskset", "Env"]
PairTaskset = SumsTaskset


class Env:  # an Env of its own, not a SingleAgentEnv: two seats
    pass
"""


ENDLESS = """
from vf1_sums import SumsTaskset

__all__ = ["EndlessTaskset"]


class EndlessTaskset(SumsTaskset):
    INFINITE = True
"""


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (ENDLESS, "is infinite: give data.train a limit"),
        (TOOLED, r"toolsets \['CalcToolset'\] give the model native tool calls"),
        (TWO_SEATS, "multi-agent environments are not supported"),
    ],
)
def test_validate_names_tools_two_seats_and_endless_ones(tmp_path, monkeypatch, source, message):
    (tmp_path / "vf1_other.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    with pytest.raises(RecipeError, match=message):
        _items(module="vf1_other")


RAISES = """
import verifiers.v1 as vf
from vf1_sums import SumsConfig, SumsTask, SumsTaskset

__all__ = ["BrokenTaskset"]


class BrokenTask(SumsTask):
    @vf.reward(weight=1.0)
    async def correct(self, trace):
        raise KeyError("answer")


class BrokenTaskset(vf.Taskset[BrokenTask, SumsConfig]):
    def load(self):
        return [BrokenTask(t.data, t.config) for t in SumsTaskset(self.config).load()]
"""


def test_a_failing_rubric_fails_only_its_samples_named(worker, tmp_path, monkeypatch):
    (tmp_path / "vf1_broken.py").write_text(RAISES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    w, folder = worker
    recipe = _recipe(str(folder), module="vf1_broken")
    (item,) = environment_items(recipe.rollout.environment, "train", "data.train", 1, None)
    req = PromptRequest("s0-p0-0", item.messages, "", item.metadata)
    tok = w.engine.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    folder = tmp_path / "agent"
    rollouts, _ = generate_agent_episodes([w], [req], recipe, decode, folder, 0, call=_direct)
    scores = add_environment_rewards(rollouts, [Score(uid=r.uid, reward=0.0) for r in rollouts])
    assert len(scores) == 2
    for r, s in zip(rollouts, scores, strict=True):
        assert s.reward is None and r.uid in s.error and "KeyError" in s.error, s.error
        assert sum(r.loss_mask) > 0  # what was sampled is kept


def _direct(worker_, verb, *args):
    return getattr(worker_, verb)(*args)


def test_a_harness_environment_of_its_own_still_starts_its_program(worker, tmp_path):
    """The program would see that environment (`harness.env`), the driver's process does
    not: it starts as a program per episode, and stays token-exact."""
    w, folder = worker
    recipe = _recipe(str(folder), harness={"id": "null", "env": {"VF1_SEEN": "1"}})
    (item,) = environment_items(recipe.rollout.environment, "train", "data.train", 1, None)
    req = PromptRequest("s0-p0-0", item.messages, "", item.metadata)
    records = {}

    def call(worker_, verb, *args):
        got = getattr(worker_, verb)(*args)
        records[args[0]] = got if verb == "pop_episode" else None
        return got

    tok = w.engine.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rollouts, _ = generate_agent_episodes([w], [req], recipe, decode, tmp_path, 0, call=call)
    assert (tmp_path / "agent_00000.log").read_text().count("started program") == 2
    for r in rollouts:
        sampled = [t for c in records[r.uid]["calls"] for t in c["completion_ids"]]
        assert [t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if m] == sampled
        assert "environment_reward" in r.metadata
