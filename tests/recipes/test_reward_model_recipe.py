"""Reward-model recipes without Ray: schema rules, hh dialogues as chat turns, the
single-turn hh prompts PPO reads, the eval split and per-pair margins."""

from __future__ import annotations

import json

import pytest

from posttrain.config import Recipe, RecipeError
from posttrain.recipes.algo.reward_model import as_chat, split_eval
from posttrain.recipes.data.pairs import PreferencePair, hh_messages, load_pairs, pair_prompts

BASE = {
    "name": "rm",
    "algorithm": "reward_model",
    "model": {"path": "m"},
    "data": {"train": {"path": "p.jsonl", "format": "hh"}},
    "train": {"steps": 1, "prompts_per_step": 2},
}


def test_schema_rules():
    r = Recipe.model_validate(BASE)
    assert r.reward_model.margin == 0.0 and r.reward_model.chat_template
    with pytest.raises(ValueError, match="calls no reward"):
        Recipe.model_validate({**BASE, "rewards": [{"name": "c", "type": "math"}]})
    with pytest.raises(ValueError, match="A reward model trains on preference pairs"):
        Recipe.model_validate({**BASE, "data": {"train": {"generator": "arithmetic"}}})
    with pytest.raises(ValueError, match="eval:"):
        Recipe.model_validate({**BASE, "eval": {"prompts": {"path": "q.jsonl"}, "every_steps": 5}})
    with pytest.raises(ValueError, match="margin"):
        Recipe.model_validate({**BASE, "reward_model": {"margin": -1}})
    ppo = {
        **BASE,
        "algorithm": "ppo",
        "rewards": [{"name": "rm", "type": "reward_model", "path": "runs/rm/final"}],
    }
    assert Recipe.model_validate(ppo).rewards[0].normalize == "none"
    # TRL preference files give GRPO / PPO prompts too (their shared prompt)
    Recipe.model_validate({**ppo, "data": {"train": {"path": "p.jsonl", "format": "pairs"}}})


HH = (
    "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Tell me a joke"
    "\n\nAssistant:"
)


def test_hh_dialogue_as_messages():
    assert hh_messages(HH) == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke"},
    ]
    chat = as_chat([PreferencePair(0, HH, " A good one.", " No.")], "hh")[0]
    assert chat.prompt[-1]["content"] == "Tell me a joke"
    assert (chat.chosen, chat.rejected) == ("A good one.", "No.")
    text = as_chat([PreferencePair(0, "Why?", "a", "b")], "pairs")[0]
    assert text.prompt == [{"role": "user", "content": "Why?"}]
    with pytest.raises(RecipeError, match="no '"):
        as_chat([PreferencePair(3, "no turns\n\nAssistant:", "a", "b")], "hh")


def test_pair_prompts_keep_single_turn_dialogues():
    pairs = [
        PreferencePair(0, HH, "a", "b"),
        PreferencePair(1, "\n\nHuman: Only one turn?\n\nAssistant:", "a", "b"),
    ]
    prompts = pair_prompts(pairs)
    assert [(p.prompt_id, p.question) for p in prompts] == [(1, "Only one turn?")]
    with pytest.raises(RecipeError, match="single-turn"):
        pair_prompts(pairs[:1])


def test_eval_split_and_its_bound():
    train, held = split_eval([4, 2, 0, 1, 3], 2)
    assert (train, held) == ([4, 2, 0], [1, 3])
    with pytest.raises(RecipeError, match="eval_pairs is 5"):
        split_eval([0, 1, 2, 3, 4], 5)


def test_margin_key(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "q", "chosen": "a", "rejected": "b", "m": 2},
        {"prompt": "q", "chosen": "a", "rejected": "b", "m": 0.5},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs, _ = load_pairs(f, "pairs", margin_key="m")
    assert [p.margin for p in pairs] == [2.0, 0.5]
    assert load_pairs(f, "pairs")[0][0].margin == 0.0
    f.write_text(json.dumps({**rows[0], "m": -1}) + "\n")
    with pytest.raises(RecipeError, match=r"p.jsonl:1: key 'm'.*>= 0"):
        load_pairs(f, "pairs", margin_key="m")
