"""Bad data is refused by `posttrain validate` (and `run`) before anything starts: exit
2, naming the file, the row and the key."""

from __future__ import annotations

import json

import datasets
import pytest
import yaml
from typer.testing import CliRunner

from posttrain.recipes.cli import app


def _recipe(tmp_path, model, train, rewards=None):
    tree = {
        "name": "bad-data",
        "algorithm": "grpo",
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train": train},
        "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
        "rewards": rewards or [{"name": "len", "type": "length", "target_chars": 3}],
        "train": {"steps": 1, "prompts_per_step": 1},
    }
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(tree))
    return f


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _validate(recipe):
    return CliRunner().invoke(app, ["validate", str(recipe)])


USER = {"role": "user", "content": "2+2?"}
BAD_ROWS = {
    "missing key": ([{"prompt": "a"}, {"question": "b"}], ":2: row has no key 'prompt'"),
    "wrong type": (
        [{"prompt": "a"}, {"prompt": True}],
        ":2: 'prompt' (data.train.prompt_key) is true",
    ),
    "empty prompt": ([{"prompt": "  "}], ":1: 'prompt' (data.train.prompt_key) is an empty prompt"),
    "messages out of order": (
        [{"prompt": [{"role": "assistant", "content": "Hi"}, USER]}],
        ":1: 'prompt' message 1 (assistant) follows nothing: out of order",
    ),
    "unknown role": (
        [{"prompt": [{"role": "narrator", "content": "Once"}, USER]}],
        ":1: 'prompt' message 1 has role \"narrator\"",
    ),
    "prompt ends with the reply": (
        [{"prompt": [USER, {"role": "assistant", "content": "4"}]}],
        ":1: 'prompt' ends with an assistant message",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_exit_2_naming_file_row_and_key(tmp_path, tiny_model, case):
    rows, needle = BAD_ROWS[case]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    got = _validate(_recipe(tmp_path, tiny_model, {"path": str(data)}))
    assert got.exit_code == 2 and f"{data}{needle}" in got.output, got.output


def test_bad_parquet_row_is_named_by_row_number(tmp_path, tiny_model):
    rows = [{"prompt": [USER]}, {"prompt": [{"role": "user", "content": "  "}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    got = _validate(_recipe(tmp_path, tiny_model, {"path": str(tmp_path / "d.parquet")}))
    assert got.exit_code == 2
    assert f"{tmp_path / 'd.parquet'} row 2: 'prompt' has no user message with text" in got.output


def test_row_no_reward_covers_is_refused(tmp_path, tiny_model):
    rows = [{"prompt": "a", "data_source": "math"}, {"prompt": "b", "data_source": "chat"}]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    rewards = [{"name": "len", "type": "length", "target_chars": 3, "sources": ["math"]}]
    got = _validate(_recipe(tmp_path, tiny_model, {"path": str(data)}, rewards))
    assert got.exit_code == 2
    assert f"{data}:2: data_source 'chat' is in no reward component's sources" in got.output
    rewards.append({"name": "any", "type": "length", "target_chars": 9, "sources": ["chat"]})
    assert _validate(_recipe(tmp_path, tiny_model, {"path": str(data)}, rewards)).exit_code == 0
    rewards.append({"name": "typo", "type": "length", "target_chars": 9, "sources": ["chta"]})
    got = _validate(_recipe(tmp_path, tiny_model, {"path": str(data)}, rewards))
    assert got.exit_code == 2 and "sources ['chta'] match no row's data_source" in got.output


def test_mixture_weight_not_above_zero_is_refused(tmp_path, tiny_model):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    mixture = {"mixture": [{"path": str(data)}, {"generator": "arithmetic", "weight": 0}]}
    got = _validate(_recipe(tmp_path, tiny_model, mixture))
    assert got.exit_code == 2
    assert "data.train.mixture.1.weight: Input should be greater than 0 (got 0)" in got.output


def test_math_reward_needs_a_ground_truth(tmp_path, tiny_model):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    got = _validate(
        _recipe(tmp_path, tiny_model, {"path": str(data)}, [{"name": "c", "type": "math"}])
    )
    assert got.exit_code == 2 and f"{data}:1: rewards.0 ('c', type math)" in got.output
