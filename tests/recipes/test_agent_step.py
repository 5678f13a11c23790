"""A step of black-box agent episodes: the example agent program (a subprocess speaking
the OpenAI chat API over httpx) against an in-process rollout worker's endpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.actors.rollout import PromptRequest
from posttrain.config import Recipe
from posttrain.recipes.episodes.agent_step import AgentProgramFailed, generate_agent_episodes
from tests.hostile_servers import SlowDrip

AGENT = Path(__file__).resolve().parents[2] / "examples" / "openai_agent.py"


def _recipe(model, command):
    return Recipe.model_validate(
        {
            "name": "agent",
            "algorithm": "grpo",
            "model": {"path": str(model)},
            "data": {"train": {"generator": "arithmetic", "size": 4}},
            "rollout": {
                "engine": "hf",
                "samples_per_prompt": 2,
                "max_new_tokens": 5,
                "temperature": 0.9,
                "agent": {"command": command, "timeout_s": 120},
            },
            "rewards": [{"name": "correct", "type": "math"}],
            "train": {"steps": 1, "prompts_per_step": 2},
        }
    )


def _direct(worker, verb, *args):
    return getattr(worker, verb)(*args)


@pytest.fixture(scope="module")
def worker(hf_worker):
    return hf_worker


def test_agent_program_episodes_become_rollouts(worker, tmp_path):
    w, folder = worker
    recipe = _recipe(folder, [sys.executable, str(AGENT)])
    reqs = [
        PromptRequest(f"s0-p{i}-{i}", [{"role": "user", "content": q}], gt)
        for i, (q, gt) in enumerate([("1+2?", "3"), ("4+4?", "8")])
    ]
    tok = w.engine.tokenizer
    rollouts, metrics = generate_agent_episodes(
        [w],
        reqs,
        recipe,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        tmp_path,
        0,
        call=_direct,
    )
    assert [r.uid for r in rollouts] == ["s0-p0-0-0", "s0-p0-0-1", "s0-p1-1-0", "s0-p1-1-1"]
    assert metrics["episode/agent_rewards"] == 4.0
    for r in rollouts:
        assert r.metadata["environment_reward"] in (0.0, 1.0)
        calls = [t for t in r.turns if t["mask"]]
        assert 1 <= len(calls) <= 2 and all(len(t["ids"]) <= 5 for t in calls)
        assert len(r.loss_mask) == len(r.response_ids) == len(r.inference_logprobs)
    assert "ran 4 episodes" in (tmp_path / "agent_00000.log").read_text()


def test_a_failing_agent_program_fails_the_step(worker, tmp_path):
    w, folder = worker
    recipe = _recipe(folder, [sys.executable, "-c", "raise SystemExit('no model for me')"])
    reqs = [PromptRequest("g", [{"role": "user", "content": "q"}])]
    with pytest.raises(AgentProgramFailed, match="exited 1"):
        generate_agent_episodes([w], reqs, recipe, str, tmp_path, 3, call=_direct)


def test_the_example_agent_bounds_each_whole_call(tmp_path):
    """An endpoint that drips its answer a byte at a time is given up on at the call's
    deadline (1 s here), not after the whole drip (per-read timeouts never fire)."""
    reply = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}}],
        "pad": "x" * 80,
    }
    episodes = tmp_path / "episodes.jsonl"
    with SlowDrip(reply) as url:
        episodes.write_text(
            json.dumps({"episode_id": "e", "base_url": url, "messages": [], "ground_truth": "4"})
        )
        env = {**os.environ, "POSTTRAIN_EPISODES": str(episodes), "AGENT_CALL_TIMEOUT_S": "1"}
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, str(AGENT)], env=env, capture_output=True, text=True, timeout=120
        )
        took = time.monotonic() - t0
    assert proc.returncode != 0 and "RequestTimeout" in proc.stderr, proc.stderr[-1500:]
    assert took < 30, took  # the drip alone takes over 40 s
