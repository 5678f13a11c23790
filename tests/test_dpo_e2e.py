"""DPO end to end on a tiny model with 2 learner ranks: precompute, cache reuse,
agreement with the in-loop reference, padding invariance, and no rollout side."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.algorithms.dpo import dpo_loss
from posttrain.learner.export import differing_model_files
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.recipes.algo.dpo import cache_key, pair_batch
from posttrain.recipes.data.pair_tokens import tokenize_pairs
from posttrain.recipes.data.pairs import PreferencePair, load_pairs
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run

ROWS = [
    {"prompt": f"Q{i}: what is {i}+{i}?", "chosen": f" {2 * i}", "rejected": f" {i}{i}"}
    for i in range(6)
]


@pytest.fixture
def dpo_recipe(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def make(precompute: bool, name: str):
        f = tmp_path / f"{name}.yaml"
        f.write_text(
            yaml.safe_dump(
                {
                    "name": name,
                    "algorithm": "dpo",
                    "model": {"path": str(tiny_model), "dtype": "float32"},
                    "data": {"train": {"path": str(data), "format": "pairs"}},
                    "dpo": {"beta": 0.1, "precompute_ref_logprobs": precompute, "max_length": 64},
                    "train": {"steps": 2, "prompts_per_step": 3, "micro_batch_size": 2, "lr": 1e-2},
                    "resources": {"learner": {"gpus": 2}, "threads_per_worker": 1},
                    "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
                }
            )
        )
        return load_recipe(f)

    return make, data


def _pairs(data):
    return load_pairs(data, "pairs")[0]


def test_precompute_cache_and_in_loop_reference_agree(dpo_recipe, tmp_path):
    make, data = dpo_recipe
    first = run(make(True, "pre"), tmp_path / "a", None, _pairs(data))
    info = json.loads((tmp_path / "a" / "precompute.json").read_text())
    assert info["cache_hit"] is False and info["pairs"] == 6
    again = run(make(True, "pre"), tmp_path / "b", None, _pairs(data))
    assert json.loads((tmp_path / "b" / "precompute.json").read_text())["cache_hit"] is True
    in_loop = run(make(False, "loop"), tmp_path / "c", None, _pairs(data))
    # step 0: policy == reference, so h = 0 and the loss is log 2 in every mode
    for h in (first, again, in_loop):
        assert h[0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    # step 1: the policy moved; the cached reference gives what the live reference gives
    assert first[1]["loss"] != pytest.approx(0.693147, abs=1e-3)
    assert first[1]["loss"] == pytest.approx(in_loop[1]["loss"], abs=1e-5)
    assert first[1]["loss"] == pytest.approx(again[1]["loss"], abs=1e-6)
    assert not (tmp_path / "a" / "rollouts").exists()  # no rollout side at all
    AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final")
    # the source's generation_config.json and tokenizer files travel into every saved policy
    assert not differing_model_files(make(True, "pre").model.path, tmp_path / "a" / "final")


def test_cache_key_changes_with_data(dpo_recipe):
    make, data = dpo_recipe
    recipe = make(True, "k")
    key = cache_key(recipe, recipe.model.path)
    data.write_text(data.read_text() + json.dumps(ROWS[0]) + "\n")
    assert cache_key(recipe, recipe.model.path) != key


def test_left_padding_does_not_change_the_loss(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    short, long = tokenize_pairs(
        [
            PreferencePair(0, "Hi", " a", " bb"),
            PreferencePair(1, "A much longer prompt here", " ccc", " d"),
        ],
        tok,
        64,
    )

    def sums(batch):
        with torch.no_grad():
            lp = sequence_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.response_start
            )
        return (lp * batch.response_mask).sum(-1)

    alone = sums(pair_batch([short], tok.pad_token_id))
    padded = sums(pair_batch([short, long], tok.pad_token_id))[:2]
    torch.testing.assert_close(alone, padded, rtol=0, atol=1e-5)
    ref = torch.tensor([-1.0, -2.0])
    a = dpo_loss(alone[:1], alone[1:], ref[:1], ref[1:]).loss
    b = dpo_loss(padded[:1], padded[1:], ref[:1], ref[1:]).loss
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
