"""Mixtures of sources by weight, held-out prompts that never meet training, and
reasoning-gym datasets by name as prompt sources."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from posttrain.config import Recipe, RecipeError
from posttrain.config.data import DataConfig
from posttrain.recipes.data import load_data, load_eval_prompts, load_prompts
from posttrain.recipes.data.items import prompt_identity
from posttrain.recipes.data.sources import shares


def _jsonl(path, questions, source=None):
    rows = [{"question": q, "answer": str(k)} for k, q in enumerate(questions)]
    if source:
        rows = [{**r, "data_source": source} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_shares_hand_values():
    assert shares([3, 1], 8) == [6, 2]
    assert shares([1, 1, 1], 10) == [4, 3, 3]  # equal remainders: the first source first
    assert shares([1, 2], 4) == [1, 3]  # exact 1.33 / 2.67: the larger remainder wins
    assert shares([0.5, 0.25, 0.25], 7) == [3, 2, 2]  # 3.5 / 1.75 / 1.75: the .75s win


def test_mixture_by_weight_with_limits(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["A0", "A1", "A2"], source="a")
    train = {
        "mixture": [
            {"path": a, "limit": 2, "weight": 3},
            {"generator": "arithmetic", "size": 10, "data_source": "b", "weight": 1},
        ],
        "size": 8,
    }
    items = load_prompts(DataConfig.model_validate({"train": train}))
    assert [i.prompt_id for i in items] == list(range(8))
    assert Counter(i.metadata["data_source"] for i in items) == {"a": 6, "b": 2}
    # source a read 2 rows (its limit) and repeats them to fill its 6 places
    assert Counter(i.question for i in items if i.metadata["data_source"] == "a") == {
        "A0": 3,
        "A1": 3,
    }
    again = load_prompts(DataConfig.model_validate({"train": train}))
    assert [i.question for i in again] == [i.question for i in items]  # seeded
    whole = load_prompts(DataConfig.model_validate({"train": {**train, "size": None}}))
    assert len(whole) == 12  # default: every source's rows once (2 + 10)


@pytest.mark.parametrize("seed", range(10))
def test_mixture_without_weights_draws_every_row_once(tmp_path, seed):
    # issue 47: sources of 3, 4 and 3 rows, no weights, no size: equal weights gave the
    # 4-row source 3 places (one row lost, another source's row drawn twice), every seed
    files = [
        _jsonl(tmp_path / f"{name}.jsonl", [f"{name}{k}" for k in range(n)], source=name)
        for name, n in (("a", 3), ("b", 4), ("c", 3))
    ]
    train = {"mixture": [{"path": f} for f in files], "seed": seed}
    items = load_prompts(DataConfig.model_validate({"train": train}))
    assert sorted(i.question for i in items) == sorted(
        ["a0", "a1", "a2", "b0", "b1", "b2", "b3", "c0", "c1", "c2"]
    )
    assert [i.prompt_id for i in items] == list(range(10))
    # with a size and no weights, the shares follow the row counts: 3/10, 4/10, 3/10 of 20
    sized = load_prompts(DataConfig.model_validate({"train": {**train, "size": 20}}))
    assert Counter(i.metadata["data_source"] for i in sized) == {"a": 6, "b": 8, "c": 6}


def _grpo(tmp_path, train, eval_=None, rewards=None):
    tree = {
        "name": "mix",
        "algorithm": "grpo",
        "model": {"path": "smollm2-135m-instruct"},
        "data": {"train": train},
        "rewards": rewards or [{"name": "len", "type": "length", "target_chars": 3}],
        "train": {"steps": 1, "prompts_per_step": 1},
    }
    if eval_ is not None:
        tree["eval"] = {"every_steps": 1, **eval_}
    return Recipe.model_validate(tree)


def test_holdout_never_meets_training(tmp_path):
    qs = [f"q{k % 10}" for k in range(20)]  # 10 distinct prompts, each twice
    r = _grpo(tmp_path, {"path": _jsonl(tmp_path / "t.jsonl", qs)}, {"holdout": 3})
    data = load_data(r)
    held = {prompt_identity(i) for i in data.eval}
    assert len(data.eval) == 3 and len(held) == 3
    assert not held & {prompt_identity(i) for i in data.train}
    assert data.held_out == 6 and len(data.train) == 14  # both copies of each held out
    assert [i.question for i in load_eval_prompts(r)] == [i.question for i in data.eval]
    with pytest.raises(RecipeError, match="eval.holdout: 10 prompts held out"):
        load_data(_grpo(tmp_path, {"path": str(tmp_path / "t.jsonl")}, {"holdout": 10}))


def test_eval_file_prompts_leave_training(tmp_path):
    train = {"path": _jsonl(tmp_path / "t.jsonl", [f"q{k}" for k in range(10)])}
    held = {"path": _jsonl(tmp_path / "e.jsonl", ["q8", "q9", "q10", "q11"])}
    data = load_data(_grpo(tmp_path, train, {"prompts": held}))
    assert data.held_out == 2 and [i.question for i in data.train] == [f"q{k}" for k in range(8)]
    limited = load_data(_grpo(tmp_path, train, {"prompts": held, "limit": 1}))
    assert limited.held_out == 1 and [i.question for i in limited.eval] == ["q8"]


def test_reasoning_gym_by_name(tmp_path):
    from posttrain.rewards.reasoning_gym import score_reasoning_gym

    train = {"reasoning_gym": "leg_counting", "size": 4, "seed": 1, "config": {"max_animals": 3}}
    items = load_prompts(DataConfig.model_validate({"train": train}))
    assert len(items) == 4 and all(i.metadata["data_source"] == "leg_counting" for i in items)
    ref = items[0].metadata["reasoning_gym"]
    assert ref == {
        "dataset": "leg_counting",
        "seed": 1,
        "size": 4,
        "config": {"max_animals": 3},
        "index": 0,
    }
    right = f"Thinking... <answer>{items[0].ground_truth}</answer>"
    assert score_reasoning_gym(right, ref, "answer") == (1.0, {"answer_found": 1.0})
    assert score_reasoning_gym("<answer>-1</answer>", ref, "answer")[0] == 0.0
    assert score_reasoning_gym(items[0].ground_truth, ref, "answer") == (
        0.0,
        {"answer_found": 0.0},
    )
    assert score_reasoning_gym(f" {items[0].ground_truth}\n", ref, None)[0] == 1.0
    with pytest.raises(ValueError, match="no reasoning_gym reference"):
        score_reasoning_gym(right, {"question": "x"}, "answer")


def test_reasoning_gym_mistakes_are_named(tmp_path):
    with pytest.raises(
        RecipeError, match=r"no dataset 'leg_countin'; did you mean \['leg_counting'"
    ):
        load_prompts(DataConfig.model_validate({"train": {"reasoning_gym": "leg_countin"}}))
    bad = {"reasoning_gym": "leg_counting", "config": {"no_such_setting": 1}}
    with pytest.raises(
        RecipeError, match=r"data.train.config: reasoning-gym's leg_counting refuses"
    ):
        load_prompts(DataConfig.model_validate({"train": bad}))
    # a reasoning_gym reward on rows of another source cannot score them
    mixture = {
        "mixture": [
            {"reasoning_gym": "leg_counting", "size": 2},
            {"path": _jsonl(tmp_path / "t.jsonl", ["q"]), "data_source": "plain"},
        ]
    }
    rg = [{"name": "rg", "type": "reasoning_gym"}]
    with pytest.raises(RecipeError, match=r"t.jsonl:1: rewards.0 \('rg', type reasoning_gym\)"):
        load_data(_grpo(tmp_path, mixture, rewards=rg))
    routed = [
        {"name": "rg", "type": "reasoning_gym", "sources": ["leg_counting"]},
        {"name": "len", "type": "length", "target_chars": 3, "sources": ["plain"]},
    ]
    assert len(load_data(_grpo(tmp_path, mixture, rewards=routed)).train) == 3


def test_pair_mixture_by_weight_and_one_prompt_shape(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "Sky?", "chosen": "Blue.", "rejected": "Red."}) + "\n")
    chat = tmp_path / "chat.jsonl"
    row = {
        "chosen": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Red."}],
    }
    chat.write_text(json.dumps(row) + "\n")
    tree = {
        "name": "pairs",
        "algorithm": "dpo",
        "model": {"path": "smollm2-135m-instruct"},
        "data": {"train": {"mixture": [{"path": str(text)}, {"path": str(text), "weight": 3}]}},
        "train": {"steps": 1, "prompts_per_step": 1},
    }
    pairs = load_data(Recipe.model_validate(tree)).train
    assert [p.pair_id for p in pairs] == [0, 1] and {p.prompt for p in pairs} == {"Sky?"}
    tree["data"]["train"]["mixture"][1]["path"] = str(chat)
    with pytest.raises(RecipeError, match=r"data.train.mixture: sources \[1\] give their prompts"):
        load_data(Recipe.model_validate(tree))
