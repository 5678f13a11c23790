"""One GRPO step end to end on a tiny random model for each kind of data a recipe can
point at: verl's RL parquet, a TRL conversational dataset saved with save_to_disk, csv,
json, jsonl, a weighted mixture (rewards routed by data_source) and a reasoning-gym task
scored by its own scorer. Each file is made here from a few rows."""

from __future__ import annotations

import json

import datasets
import pytest
import yaml

from posttrain.recipes.data import load_data
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run

SYS = {"role": "system", "content": "Reply with one number."}
MATH = [{"name": "correct", "type": "math"}]


def _user(text):
    return [{"role": "user", "content": text}]


def _verl(tmp_path):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": ([SYS] if i == 0 else []) + _user(f"What is {i} + 2?"),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(3)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    return {"path": "train.parquet"}, MATH


def _trl(tmp_path):
    conv = datasets.Dataset.from_dict(
        {
            "prompt": [_user(f"What is {i} + 3?") for i in range(3)],
            "completion": [[{"role": "assistant", "content": str(i + 3)}] for i in range(3)],
        }
    )
    datasets.DatasetDict({"train": conv}).save_to_disk(str(tmp_path / "trl"))
    return {"path": "trl"}, MATH


def _csv(tmp_path):
    (tmp_path / "d.csv").write_text("question,answer\n1 + 1?,2\n2 + 2?,4\n3 + 3?,6\n")
    return {"path": "d.csv"}, MATH


def _json(tmp_path):
    rows = [{"prompt": f"{i} + 4?", "solution": str(i + 4)} for i in range(3)]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    return {"path": "d.json"}, MATH


def _jsonl(tmp_path):
    rows = [
        {"messages": [*_user(f"{i} + 5?"), {"role": "assistant", "content": str(i + 5)}]}
        for i in range(3)
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"path": "d.jsonl"}, MATH


def _mixture(tmp_path):
    (tmp_path / "m.jsonl").write_text(
        "".join(
            json.dumps({"question": f"{i} + 6?", "answer": str(i + 6)}) + "\n" for i in range(3)
        )
    )
    train = {
        "mixture": [
            {"path": "m.jsonl", "data_source": "sums", "weight": 2},
            {"reasoning_gym": "leg_counting", "size": 4, "weight": 1},
        ],
        "size": 3,
    }
    rewards = [
        {"name": "correct", "type": "math", "sources": ["sums"]},
        {"name": "legs", "type": "reasoning_gym", "sources": ["leg_counting"]},
    ]
    return train, rewards


def _reasoning_gym(tmp_path):
    return {"reasoning_gym": "leg_counting", "size": 6, "seed": 2}, [
        {"name": "legs", "type": "reasoning_gym", "answer_tag": None}
    ]


KINDS = {
    "verl_parquet": _verl,
    "trl_save_to_disk": _trl,
    "csv": _csv,
    "json": _json,
    "jsonl_messages": _jsonl,
    "mixture": _mixture,
    "reasoning_gym": _reasoning_gym,
}


#: Kinds whose loaders tests/recipes/test_data_formats.py covers row by row: their run
#: end to end is the same loop as the kinds kept in the default run (`-m slow` runs all).
LOOP_ONLY = {"trl_save_to_disk", "csv", "json", "jsonl_messages", "verl_parquet"}


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=[pytest.mark.slow] if k in LOOP_ONLY else []) for k in KINDS]
)
def test_one_grpo_step_on_each_kind_of_data(tiny_model, tmp_path, kind):
    train, rewards = KINDS[kind](tmp_path)
    recipe = {
        "name": f"data-{kind}",
        "algorithm": "grpo",
        "model": {"path": str(tiny_model), "dtype": "float32", "system_prompt": "Be brief."},
        "data": {"train": train},
        "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
        "rewards": rewards,
        "train": {"steps": 1, "prompts_per_step": 3, "micro_batch_size": 6, "save_final": False},
        "resources": {"rollout": {"gpus": 1}, "learner": {"gpus": 1}, "threads_per_worker": 1},
        "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    r = load_recipe(tmp_path / "r.yaml")
    prompts = load_data(r).train
    history = run(r, tmp_path / "run", None, prompts)
    assert [h["policy_version"] for h in history] == [1]
    assert history[0]["failed_scores"] == 0
    saved = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_00000.jsonl").open()]
    assert len(saved) == 6 and all(s["reward"] is not None for s in saved)
    if kind == "verl_parquet":  # the row's own system message replaced model.system_prompt
        texts = [s["prompt_text"] for s in saved]
        assert any(SYS["content"] in t and "Be brief." not in t for t in texts)
        assert all(s["metadata"]["data_source"] == "openai/gsm8k" for s in saved)
    if kind in ("mixture", "reasoning_gym"):
        legs = [s for s in saved if s["metadata"]["data_source"] == "leg_counting"]
        assert legs and all("legs" in s["reward_details"] for s in legs)
        assert all("correct" not in s["reward_details"] for s in legs)
