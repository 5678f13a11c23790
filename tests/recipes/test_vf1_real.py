"""The REAL verifiers 0.4 (`verifiers.v1`) behind `rollout.environment: {type:
verifiers, api: v1}`: examples/vf1_sums.py loaded by verifiers itself, its `null`
harness (verifiers' chat program, run in the driver's process, behind verifiers'
interception server) calling an in-process rollout worker's endpoint with `stream:
true`; the episode's ids are the engine's, its `@vf.reward` scores the components.

Skipped unless $POSTTRAIN_VF1_PYTHON names an interpreter with verifiers>=0.4 (it
cannot share posttrain's venv: it pins openai<3 and mcp==2.0.0; scripts/vf1_venv.sh
makes one layered on posttrain's), so CI runs the stand-in (test_vf1_env.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import PromptRequest
from posttrain.actors.worker import RolloutWorker
from posttrain.config import Recipe
from posttrain.recipes.data.environment import environment_items
from posttrain.recipes.episodes.agent_step import generate_agent_episodes
from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("POSTTRAIN_VF1_PYTHON")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON, reason="set POSTTRAIN_VF1_PYTHON to a verifiers 0.4 python"),
]


def test_real_verifiers_v1_episode_is_token_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "examples"))
    folder = build_tiny_model(tmp_path / "m", max_positions=1024)
    env = {"type": "verifiers", "api": "v1", "module": "vf1_sums", "args": {"num_tasks": 2}}
    env |= {"harness": {"id": "null"}, "python": PYTHON, "timeout_s": 300}
    recipe = Recipe.model_validate(
        {
            "name": "vf1-real",
            "algorithm": "grpo",
            "model": {"path": str(folder)},
            "data": {"train": {"environment": "train"}},
            "rollout": {
                "engine": "hf",
                "samples_per_prompt": 2,
                "max_new_tokens": 6,
                "temperature": 0.9,
                "environment": env,
            },  # fmt: skip
            "rewards": [{"name": "none", "type": "length", "target_chars": 1, "weight": 0.0}],
            "train": {"steps": 1, "prompts_per_step": 1},
        }
    )
    (item,) = environment_items(recipe.rollout.environment, "train", "data.train", 1, None)
    settings = EngineSettings(kind="hf", model_path=str(folder), dtype="float32")
    w = RolloutWorker(0, settings, "object_store", threads=1)
    records = {}

    def call(worker, verb, *args):
        got = getattr(worker, verb)(*args)
        records[args[0]] = got if verb == "pop_episode" else None
        return got

    try:
        req = PromptRequest("s0-p0-0", item.messages, "", item.metadata)
        tok = w.engine.tokenizer
        rollouts, _ = generate_agent_episodes(
            [w], [req], recipe, lambda ids: tok.decode(ids, skip_special_tokens=True),
            tmp_path / "agent", 0, call=call,
        )  # fmt: skip
    finally:
        w.close()
    for r in rollouts:
        calls = records[r.uid]["calls"]
        sampled = [t for c in calls for t in c["completion_ids"]]
        assert [t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if m] == sampled
        numbers = re.findall(r"-?\d+", r.response_text)
        correct = float(bool(numbers) and int(numbers[-1]) == 27)
        short = float(len(r.response_text.strip()) <= 40)
        assert r.metadata["environment_components"] == {"correct": correct, "short": short}
