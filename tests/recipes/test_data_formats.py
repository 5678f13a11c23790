"""Data in the formats the field uses, read with no mapping: verl's RL parquet, TRL's
datasets (standard and conversational, save_to_disk), csv / json / jsonl, folders of
shards, and preference pairs for DPO and reward models. Every file is made here from a
few rows."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from posttrain.config import Recipe, RecipeError
from posttrain.config.data import DataConfig
from posttrain.recipes.data import load_data, load_prompts
from posttrain.recipes.data.items import chat_messages

SYS = {"role": "system", "content": "Answer with a number."}


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _prompts(**train):
    return load_prompts(DataConfig.model_validate({"train": train}))


def verl_rows(n: int = 3) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": _user(f'What is {i} + 1? Output the final answer after "####".'),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def test_verl_parquet_loads_with_no_mapping(tmp_path):
    rows = verl_rows()
    rows[2]["prompt"] = [SYS, *rows[2]["prompt"]]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    items = _prompts(path=str(tmp_path / "train.parquet"))
    assert [i.ground_truth for i in items] == ["1", "2", "3"]
    first = items[0]
    assert first.messages == rows[0]["prompt"] and first.question.startswith("What is 0 + 1?")
    assert first.metadata["data_source"] == "openai/gsm8k"
    assert first.metadata["extra_info"] == {"split": "train", "index": 0}
    assert first.origin == f"{tmp_path / 'train.parquet'} row 1"
    # model.system_prompt goes in front, unless the row brings its own system message
    assert chat_messages(first, "Be brief.")[0] == {"role": "system", "content": "Be brief."}
    assert chat_messages(items[2], "Be brief.") == rows[2]["prompt"]


def test_verl_folder_of_splits(tmp_path):
    datasets.Dataset.from_list(verl_rows(3)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(verl_rows(1)).to_parquet(str(tmp_path / "test.parquet"))
    assert len(_prompts(path=str(tmp_path))) == 3  # split train by default
    assert len(_prompts(path=str(tmp_path), split="test")) == 1
    with pytest.raises(RecipeError, match=r"no split 'dev'; its splits are \['test', 'train'\]"):
        _prompts(path=str(tmp_path), split="dev")
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        datasets.Dataset.from_list(verl_rows(2)).to_parquet(
            str(shards / f"train-0000{k}-of-00002.parquet")
        )
    items = _prompts(path=str(shards))
    assert len(items) == 4 and items[3].origin.endswith("train-00001-of-00002.parquet row 2")


def test_trl_conversational_save_to_disk(tmp_path):
    conv = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {
                    "prompt": [[SYS, *_user("2+2?")], _user("3+3?")],
                    "completion": [[{"role": "assistant", "content": "4"}]] * 2,
                }
            ),
            "test": datasets.Dataset.from_dict(
                {
                    "prompt": [_user("5+5?")],
                    "completion": [[{"role": "assistant", "content": "10"}]],
                }
            ),
        }
    )
    conv.save_to_disk(str(tmp_path / "conv"))
    items = _prompts(path=str(tmp_path / "conv"))
    assert [i.question for i in items] == ["2+2?", "3+3?"] and items[0].ground_truth == "4"
    assert items[0].messages[0] == SYS and "completion" not in items[0].metadata
    assert _prompts(path=str(tmp_path / "conv"), split="test")[0].ground_truth == "10"
    # TRL's standard (text) prompt-only layout, a plain Dataset folder
    datasets.Dataset.from_dict({"prompt": ["The sky is"]}).save_to_disk(str(tmp_path / "std"))
    [item] = _prompts(path=str(tmp_path / "std"))
    assert (item.question, item.messages, item.ground_truth) == ("The sky is", None, "")


def test_trl_messages_layout_drops_the_reply_from_the_prompt(tmp_path):
    f = tmp_path / "chat.jsonl"
    talk = [*_user("Hi"), {"role": "assistant", "content": "Hello."}, *_user("2+2?")]
    f.write_text(json.dumps({"messages": [*talk, {"role": "assistant", "content": "4"}]}) + "\n")
    [item] = _prompts(path=str(f))
    assert item.messages == talk and item.question == "2+2?" and item.ground_truth == "4"
    assert _prompts(path=str(f), prompt_key="messages") == [item]  # named, not picked: the same


def test_csv_json_and_jsonl(tmp_path):
    (tmp_path / "d.csv").write_text('question,answer\n"What is 1, plus 1?",#### 2\nWhy?,7\n')
    items = _prompts(path=str(tmp_path / "d.csv"))
    assert [(i.question, i.ground_truth) for i in items] == [
        ("What is 1, plus 1?", "2"),
        ("Why?", "7"),
    ]
    assert items[1].origin == f"{tmp_path / 'd.csv'} row 2"
    rows = [{"prompt": "Say hi", "completion": "hi"}, {"prompt": "Say yo", "completion": "yo"}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert [i.ground_truth for i in _prompts(path=str(tmp_path / "d.json"))] == ["hi", "yo"]
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(_prompts(path=str(tmp_path / "lines.json"))) == 2
    (tmp_path / "d.jsonl").write_text(json.dumps({"q": "x", "sys": "Be terse.", "a": 3}) + "\n")
    [item] = _prompts(
        path=str(tmp_path / "d.jsonl"), prompt_key="q", answer_key="a", system_key="sys"
    )
    assert item.messages == [{"role": "system", "content": "Be terse."}, *_user("x")]
    assert item.ground_truth == "3" and item.origin == f"{tmp_path / 'd.jsonl'}:1"


def _pair_recipe(path: Path, algorithm: str) -> Recipe:
    tree = {
        "name": "p",
        "algorithm": algorithm,
        "model": {"path": "smollm2-135m-instruct"},
        "data": {"train": {"path": str(path)}},
        "train": {"steps": 1, "prompts_per_step": 1},
    }
    if algorithm != "reward_model":
        tree["rewards"] = [{"name": "len", "type": "length", "target_chars": 3}]
    if algorithm == "reward_model":
        tree["reward_model"] = {"eval_pairs": 0}
    return Recipe.model_validate(tree)


TRL_PREFERENCE = {
    # TRL's docs: the four preference layouts, each one row
    "standard_explicit": {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    "standard_implicit": {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    "conversational_explicit": {
        "prompt": _user("What color is the sky?"),
        "chosen": [{"role": "assistant", "content": "It is blue."}],
        "rejected": [{"role": "assistant", "content": "It is green."}],
    },
    "conversational_implicit": {
        "chosen": [
            *_user("What color is the sky?"),
            {"role": "assistant", "content": "It is blue."},
        ],
        "rejected": [
            *_user("What color is the sky?"),
            {"role": "assistant", "content": "It is green."},
        ],
    },
}


@pytest.mark.parametrize("layout", sorted(TRL_PREFERENCE))
def test_trl_preference_for_dpo_reward_model_and_grpo(tmp_path, layout):
    folder = tmp_path / layout
    datasets.Dataset.from_list([TRL_PREFERENCE[layout]]).save_to_disk(str(folder))
    text = layout.startswith("standard")
    for algorithm in ("dpo", "reward_model"):
        [pair] = load_data(_pair_recipe(folder, algorithm)).train
        if text:
            assert (pair.prompt, pair.chosen, pair.rejected) == ("The sky is", " blue.", " green.")
        else:
            assert pair.prompt == _user("What color is the sky?")
            assert (pair.chosen, pair.rejected) == ("It is blue.", "It is green.")
    [prompt] = load_data(_pair_recipe(folder, "grpo")).train
    assert prompt.question == ("The sky is" if text else "What color is the sky?")


def test_hh_rows_read_from_parquet_too(tmp_path):
    row = {
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!",
        "rejected": "\n\nHuman: Hi\n\nAssistant: Go.",
    }
    datasets.Dataset.from_list([row]).to_parquet(str(tmp_path / "hh.parquet"))
    r = _pair_recipe(tmp_path / "hh.parquet", "dpo")
    r = r.model_copy(
        update={
            "data": DataConfig.model_validate(
                {"train": {"path": str(tmp_path / "hh.parquet"), "format": "hh"}}
            )
        }
    )
    [pair] = load_data(r).train
    assert (pair.prompt, pair.chosen, pair.hh) == ("\n\nHuman: Hi\n\nAssistant:", " Hello!", True)


def test_multi_turn_prompts_render_as_rollouts_render_them(tmp_path, tiny_model):
    """The messages a rollout samples from are the row's turns (model.system_prompt in
    front unless the row has a system message), the same in single-turn generation, the
    episode steps and the length check, which counts the chat template's tokens."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from posttrain.recipes import controller as c
    from posttrain.recipes.episodes.step import requests_for
    from posttrain.recipes.loading import load_recipe
    from posttrain.recipes.preflight import checked_prompt_tokens

    talk = [
        *_user("Hi"),
        {"role": "assistant", "content": "Hello, how can I help?"},
        *_user("2+2?"),
    ]
    rows = [{"prompt": talk, "answer": "4"}, {"prompt": [SYS, *talk], "answer": "4"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        json.dumps(
            {
                "name": "turns",
                "algorithm": "grpo",
                "model": {"path": str(tiny_model), "system_prompt": "Be brief."},
                "data": {"train": {"path": "d.jsonl"}},
                "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
                "rewards": [{"name": "c", "type": "math"}],
                "train": {"steps": 1, "prompts_per_step": 2},
            }
        )
    )
    recipe = load_recipe(recipe_file)
    prompts = load_data(recipe).train
    want = [[{"role": "system", "content": "Be brief."}, *talk], [SYS, *talk]]
    chunks, _ = c.generation_requests(SimpleNamespace(rollout=[None]), prompts, recipe, 0)
    assert [r.messages for r in chunks[0]] == want
    assert [r.messages for r in requests_for(prompts, recipe, 0)] == want
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        for m in want
    ]
    assert checked_prompt_tokens(recipe, prompts) == max(len(i) for i in ids)


def test_prompt_messages_keep_the_keys_templates_read(tmp_path):
    # issue 47's sibling: a multi-turn prompt's earlier assistant turn keeps its
    # reasoning and tool calls for the chat template; other keys are refused
    call = [{"type": "function", "function": {"name": "add", "arguments": "{}"}}]
    turns = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add", "tool_calls": call},
        {"role": "user", "content": "and 3+3?"},
    ]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": turns, "answer": "6"}) + "\n")
    [item] = _prompts(path=str(f))
    assert item.messages[1] == turns[1]
    turns[1]["weight"] = 0
    f.write_text(json.dumps({"prompt": turns, "answer": "6"}) + "\n")
    with pytest.raises(RecipeError, match=rf"{f}:1: 'prompt' message 2 has key 'weight'"):
        _prompts(path=str(f))


def test_a_pair_reply_with_reasoning_is_refused_not_cut(tmp_path):
    from posttrain.recipes.data.pairs import load_pairs

    reply = [{"role": "assistant", "content": "4", "reasoning_content": "add"}]
    row = {"prompt": _user("2+2?"), "chosen": reply, "rejected": "5"}
    f = tmp_path / "pairs.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(RecipeError, match=rf"{f}:1: key 'chosen' is an assistant message with"):
        load_pairs(f, "auto")


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_null_extra_info_reaches_a_python_reward_as_verl_passes_it(tmp_path, kind):
    # issue 47: `extra_info: null` reached a verl-style reward as None (verl passes {})
    from posttrain.rewards.protocol import ScoreItem
    from posttrain.rewards.python_reward import score_python

    rows = verl_rows(2)
    rows[1]["extra_info"] = None
    f = tmp_path / f"train.{kind}"
    if kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(f))
    else:
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = _prompts(path=str(f))
    assert [i.metadata["extra_info"] for i in items] == [{"split": "train", "index": 0}, {}]

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return float(extra_info.get("index", -1))

    scored = [
        score_python(compute_score, ScoreItem(uid="u", response="2", metadata=i.metadata))[0]
        for i in items
    ]
    assert scored == [0.0, -1.0]


def test_extra_info_that_is_not_a_mapping_is_refused(tmp_path):
    rows = verl_rows(2)
    rows[1]["extra_info"] = "index 1"
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecipeError, match=rf"{f}:2: 'extra_info' is \"index 1\"; verl's"):
        _prompts(path=str(f))
