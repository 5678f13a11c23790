"""Both hub adapters end to end on the tiny random model, no network: one GRPO step and
an evaluation of episodes with the example verifiers environment (through the local
stand-in of the verifiers package), one GRPO step on the example verifiers 0.4 taskset
(through the stand-in of verifiers.v1), and one GRPO step against the example OpenEnv
server over WebSocket, started and stopped by the run (`rollout.environment.serve`)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run

ROOT = Path(__file__).resolve().parents[1]


def _recipe(tiny_model, rollout: dict, data: dict, algorithm: str = "grpo", **extra) -> dict:
    return {
        "name": "tiny-hub-env",
        "algorithm": algorithm,
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {"train": data},
        "rollout": {
            "engine": "hf",
            "samples_per_prompt": 2,
            "max_new_tokens": 6,
            "stop": list("aeiou"),
            "max_episode_tokens": 100,
            **rollout,
        },  # fmt: skip
        "rewards": [{"name": "none", "type": "length", "target_chars": 3, "weight": 0.0}],
        "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "lr": 1e-3},
        "resources": {"rollout": {"gpus": 1}, "learner": {"gpus": 1}, "threads_per_worker": 1},
        "weight_sync": {"type": "object_store"},
        "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
        **extra,
    }


def _run(recipe: dict, tmp_path: Path) -> tuple[list[dict], Path]:
    f = tmp_path / "recipe.yaml"
    f.write_text(yaml.safe_dump(recipe))
    history = run(load_recipe(f), tmp_path / "run")
    return history, tmp_path / "run"


def _trajectories_are_consistent(saved: list[dict]) -> None:
    for r in saved:
        assert len(r["loss_mask"]) == len(r["response_ids"]) == len(r["inference_logprobs"])
        assert [i for t in r["turns"] for i in t["ids"]] == r["response_ids"]
        assert [m for t in r["turns"] for m in [t["mask"]] * len(t["ids"])] == r["loss_mask"]


def _calc_game(monkeypatch) -> dict:
    """The example verifiers environment (through the stand-in package), 8 rows + 2 held out."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "stand_ins"))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return {"type": "verifiers", "module": "vf_calc_game", "args": {"size": 8, "eval_size": 2}}


def test_a_verifiers_environment_trains_and_evaluates(tiny_model, tmp_path, monkeypatch):
    env = _calc_game(monkeypatch)
    recipe = _recipe(
        tiny_model,
        {"max_turns": 2, "environment": env},
        {"environment": "train"},
        eval={"prompts": {"environment": "eval"}, "every_steps": 1, "before_train": False, "k": 1},
    )
    history, run_dir = _run(recipe, tmp_path)
    assert history[0]["policy_version"] == 1 and history[0]["failed_scores"] == 0
    # each rubric function is a reward component in the metrics
    assert "reward/correct" in history[0] and "reward/answered" in history[0]
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    evaluated = next(m for m in logged if "eval/prompts" in m)
    assert evaluated["eval/prompts"] == 2 and evaluated["eval/episode/turns_mean"] >= 1.0
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00000.jsonl").open()]
    assert len(saved) == 4 and all("correct" in r["reward_details"] for r in saved)
    assert any(len(r["turns"]) > 1 for r in saved)  # the game answered between turns
    _trajectories_are_consistent(saved)
    assert "verifiers" in sys.modules and sys.modules["verifiers"].__version__.endswith("stand-in")


def _served_game(monkeypatch) -> tuple[dict, list]:
    """The example OpenEnv game started by the run (`serve`), and the servers started."""
    from posttrain.recipes.roles import env_server

    servers, launch = [], env_server.launch
    monkeypatch.setattr(env_server, "launch", lambda *a: servers.append(launch(*a)) or servers[-1])
    game = [sys.executable, str(ROOT / "examples" / "openenv_game.py"), "--port", "{port}"]
    env = {"type": "openenv", "url": "http://127.0.0.1:{port}", "observation_key": "feedback",
           "prompt": "observation", "retries": 0, "serve": {"command": game},
           "mcp_tools": True}  # fmt: skip
    return env, servers


def _stopped(server) -> bool:
    deadline = time.time() + 15
    while server.proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    return server.proc.poll() is not None


def test_an_openenv_server_trains(tiny_model, tmp_path, monkeypatch):
    env, servers = _served_game(monkeypatch)
    recipe = _recipe(  # the tools' text takes ~410 of the tiny model's 512 tokens
        tiny_model,
        {"max_turns": 3, "environment": env, "max_episode_tokens": 60},
        {"generator": "arithmetic", "size": 4, "seed": 1},
    )
    history, run_dir = _run(recipe, tmp_path)
    assert history[0]["policy_version"] == 1 and history[0]["failed_scores"] == 0
    assert history[0]["episode/environment_errors"] == 0 and history[0]["episode/turns_mean"] > 1
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00000.jsonl").open()]
    assert len(saved) == 4 and any("environment" in r["reward_details"] for r in saved)
    _trajectories_are_consistent(saved)
    # its MCP tool was listed at reset and shown in the system message
    assert all("- compare: Says whether" in r["prompt_text"] for r in saved)
    # the run started the game's server, played on it, and stopped it at the end
    assert len(servers) == 1 and _stopped(servers[0])
    assert "GET /health" in (run_dir / "environment_server.log").read_text()
    assert "{port}" in (run_dir / "recipe.yaml").read_text()  # a resume picks a port again


@pytest.mark.slow  # 33 s; tests/recipes/test_env_server.py stops it on the failure paths
def test_a_failing_run_stops_its_environment_server(tiny_model, tmp_path, monkeypatch):
    from posttrain.recipes import loop

    env, servers = _served_game(monkeypatch)

    def fails(run, *args):
        assert servers[0].proc.poll() is None  # up while the run trains
        raise RuntimeError("a step failed")

    monkeypatch.setattr(loop, "_train", fails)
    recipe = _recipe(
        tiny_model,
        {"max_turns": 3, "environment": env},
        {"generator": "arithmetic", "size": 4, "seed": 1},
    )
    with pytest.raises(RuntimeError, match="a step failed"):
        _run(recipe, tmp_path)
    assert len(servers) == 1 and _stopped(servers[0])


def test_ppo_trains_on_episodes_with_values_on_model_tokens_only(tiny_model, tmp_path, monkeypatch):
    env = _calc_game(monkeypatch)
    recipe = _recipe(
        tiny_model,
        {"max_turns": 2, "environment": env},
        {"environment": "train"},
        algorithm="ppo",
        ppo={"epochs": 1, "mini_batches": 1, "critic_lr": 1e-3},
    )
    history, run_dir = _run(recipe, tmp_path)
    h = history[0]
    assert h["policy_version"] == 1 and h["failed_scores"] == 0
    assert h["value_loss"] > 0 and "explained_variance" in h and "reward/correct" in h
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00000.jsonl").open()]
    assert any(0 in r["loss_mask"] for r in saved)  # environment tokens in some episode
    _trajectories_are_consistent(saved)


def test_the_example_recipes_validate(monkeypatch):
    from typer.testing import CliRunner

    from posttrain.recipes.cli import app

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "stand_ins"))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    for name in ("vf_calc_game.yaml", "openenv_game.yaml"):
        got = CliRunner().invoke(app, ["validate", str(ROOT / "examples" / name)])
        assert got.exit_code == 0 and "ok:" in got.output, got.output


def test_a_verifiers_v1_taskset_trains(tiny_model, tmp_path, monkeypatch):
    """verifiers 0.4's API (through the stand-in of verifiers.v1): the driver runs each
    episode against the run's rollout workers; the rubric's rewards are components."""
    paths = [str(ROOT / "examples"), str(ROOT / "tests" / "stand_ins")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    env = {"type": "verifiers", "api": "v1", "module": "vf1_sums", "args": {"num_tasks": 4},
           "harness": {"id": "null"}}  # fmt: skip
    recipe = _recipe(tiny_model, {"environment": env}, {"environment": "train"})
    del recipe["rollout"]["stop"], recipe["rollout"]["max_episode_tokens"]
    history, run_dir = _run(recipe, tmp_path)
    assert history[0]["policy_version"] == 1 and history[0]["failed_scores"] == 0
    assert "reward/correct" in history[0] and "reward/short" in history[0]
    saved = [json.loads(x) for x in (run_dir / "rollouts" / "step_00000.jsonl").open()]
    assert len(saved) == 4 and all({"correct", "short"} <= set(r["reward_details"]) for r in saved)
    _trajectories_are_consistent(saved)
