"""Two GRPO steps of multi-turn episodes end to end on the tiny random model: the
loop's episode branch (rollout worker `generate_ids` turn by turn), a user environment
(the example guessing game as a Python class) answering every turn, environment rewards
added to the reward components, loss masks through the learner, rollout files with every
turn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_two_multi_turn_grpo_steps(tiny_model, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    recipe = {
        "name": "tiny-episodes",
        "algorithm": "grpo",
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {"train": {"generator": "arithmetic", "size": 20, "seed": 1}},
        "rollout": {
            "engine": "hf",
            "samples_per_prompt": 4,
            "max_new_tokens": 6,
            "stop": list("aeiou"),
            "max_turns": 3,
            "max_episode_tokens": 120,
            "environment": {"type": "python", "class_path": "guess_env:GuessingGame"},
        },
        "rewards": [{"name": "short", "type": "length", "target_chars": 3}],
        "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 4, "lr": 1e-3},
        "resources": {"rollout": {"gpus": 1}, "learner": {"gpus": 1}, "threads_per_worker": 1},
        "weight_sync": {"type": "object_store"},
        "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
        "eval": {
            "prompts": {"generator": "arithmetic", "size": 3, "seed": 2},
            "every_steps": 2,
            "before_train": False,
            "k": 2,
        },
    }
    recipe_file = tmp_path / "tiny.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)
    assert [h["policy_version"] for h in history] == [1, 2]
    # the evaluation samples episodes as training does: k whole episodes per prompt
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    evaluated = next(m for m in logged if "eval/prompts" in m)
    assert evaluated["eval/prompts"] == 3 and evaluated["eval/episode/turns_mean"] > 1.0
    assert 0.0 <= evaluated["eval/episode/tool_call_rate"] <= 1.0
    held = [json.loads(x) for x in (run_dir / "eval" / "step_00002.jsonl").open()]
    assert len(held) == 6 and any(len(r["turns"]) > 1 for r in held)
    for m in history:
        assert m["episode/turns_mean"] > 1.0 and m["failed_scores"] == 0
        assert 0.0 < m["episode/model_token_fraction"] < 1.0
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00001.jsonl").open()]
    assert len(saved) == 8 and all(r["policy_version"] == 1 for r in saved)
    multi = [r for r in saved if len(r["turns"]) > 1]
    assert multi
    for r in saved:
        assert len(r["loss_mask"]) == len(r["response_ids"]) == len(r["inference_logprobs"])
        assert [i for t in r["turns"] for i in t["ids"]] == r["response_ids"]
        assert r["turns"][0]["role"] == "assistant" and r["turns"][0]["mask"] == 1
    for r in multi:  # the game answered: its (0.0) reward was added as a component
        assert "environment" in r["reward_details"] and r["metadata"]["environment_reward"] == 0
    assert "guess_env" in sys.modules


def test_two_grpo_steps_with_a_black_box_agent(tiny_model, tmp_path):
    """`rollout.agent`: the example httpx agent program calls the rollout worker's
    OpenAI-compatible endpoint (a Ray actor's server thread); its rewards are trained on."""
    recipe = {
        "name": "tiny-agent",
        "algorithm": "grpo",
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {"train": {"generator": "arithmetic", "size": 20, "seed": 1}},
        "rollout": {
            "engine": "hf",
            "samples_per_prompt": 2,
            "max_new_tokens": 5,
            "agent": {
                "command": [sys.executable, str(EXAMPLES / "openai_agent.py")],
                "timeout_s": 120,
            },
        },
        "rewards": [{"name": "short", "type": "length", "target_chars": 3}],
        "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 4, "lr": 1e-3},
        "resources": {"rollout": {"gpus": 1}, "learner": {"gpus": 1}, "threads_per_worker": 1},
        "weight_sync": {"type": "object_store"},
        "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
        # evaluated on whole agent episodes after the last step (it raised a KeyError)
        "eval": {"holdout": 2, "every_steps": 2, "k": 1},
    }
    recipe_file = tmp_path / "agent.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)
    assert [h["policy_version"] for h in history] == [1, 2]
    assert all(h["episode/agent_rewards"] == 4.0 for h in history)
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00001.jsonl").open()]
    assert len(saved) == 4 and all(r["policy_version"] == 1 for r in saved)
    for r in saved:
        assert "environment" in r["reward_details"]
        assert [i for t in r["turns"] for i in t["ids"]] == r["response_ids"]
    assert (run_dir / "agent" / "episodes_00001.jsonl").is_file()
    final = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()][-1]
    assert final["eval/policy_version"] == 2 and final["eval/prompts"] == 2
    assert final["eval/episode/agent_rewards"] == 2.0  # every held-out episode posted one
    assert "eval/episode/tool_call_rate" not in final  # its tools are the program's
