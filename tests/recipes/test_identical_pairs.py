"""Preference pairs that truncation makes identical (chosen == rejected token for token)
carry no preference: the loss is log 2 with zero gradient and accuracy counts a tie. They
are dropped, and counted in the data summary, for DPO and the reward model alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from posttrain.config import Recipe, RecipeError
from posttrain.recipes.algo.dpo import DPO
from posttrain.recipes.algo.reward_model import RewardModel
from posttrain.recipes.data.pair_tokens import tokenize_pairs_with_template
from posttrain.recipes.data.pairs import PreferencePair

PROMPT = "abcdef"  # 6 tokens with the tiny character-level tokenizer


def test_hand_case_max_length_8(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok(PROMPT, add_special_tokens=False)["input_ids"]) == 6
    pairs = [PreferencePair(0, PROMPT, "A B C", "A B D"), PreferencePair(1, "ab", "A", "B")]
    done = tokenize_pairs_with_template(pairs, tok, max_length=8)
    # the prompt keeps 4 tokens, the replies their first 4: "A B " both
    assert done.identical == 1 and done.kept == [1]
    [t] = done.pairs
    assert t.chosen_ids != t.rejected_ids
    assert "1 of 2 pairs dropped" in done.description and "max_length 8" in done.description


def test_every_pair_identical_is_an_error_naming_max_length(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with pytest.raises(RecipeError, match="max_length 8"):
        tokenize_pairs_with_template([PreferencePair(0, PROMPT, "A B C", "A B D")], tok, 8)


def _recipe(algorithm: str, block: dict) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "p",
            "algorithm": algorithm,
            "model": {"path": "m"},
            "data": {"train": {"path": "p.jsonl", "format": "pairs"}},
            "train": {"steps": 1, "prompts_per_step": 1},
            algorithm: block,
        }
    )


# max_length 9 (the schema's least): a 6-token prompt keeps 4, the replies their first 5
PAIRS = [
    PreferencePair(0, PROMPT, "A B C D", "A B C E", margin=5.0),  # "A B C" both: dropped
    PreferencePair(1, "ab", "A", "B", margin=1.0),  # fits
]


def test_dpo_drops_and_reports_them(tiny_model, capsys):
    algo = DPO(_recipe("dpo", {"max_length": 9, "precompute_ref_logprobs": False}))
    algo.prepare(SimpleNamespace(model_path=str(tiny_model), data=PAIRS))
    assert len(algo.pairs) == 1 and algo.order == [0]
    assert "1 of 2 pairs dropped" in capsys.readouterr().out


def test_reward_model_drops_and_keeps_margins_aligned(tiny_model, capsys):
    algo = RewardModel(_recipe("reward_model", {"max_length": 9}))
    algo.prepare(SimpleNamespace(model_path=str(tiny_model), data=PAIRS))
    assert len(algo.pairs) == 1 and algo.margins == [1.0]
    assert algo.pairs[0].chosen_ids != algo.pairs[0].rejected_ids
    assert "1 of 2 pairs dropped" in capsys.readouterr().out
