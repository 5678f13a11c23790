"""Preference data: HH-RLHF splitting, the pairs format, tokenisation and truncation."""

from __future__ import annotations

import gzip
import json

import pytest
from transformers import AutoTokenizer

from posttrain.recipes.preference import HH_MARK, load_pairs, tokenize_pairs
from posttrain.config import RecipeError


def test_hh_split_on_real_data(shared_data):
    pairs, skipped = load_pairs(shared_data / "hh-rlhf-harmless" / "test.jsonl.gz", "hh")
    assert len(pairs) + skipped == 2312 and skipped < 10
    with gzip.open(shared_data / "hh-rlhf-harmless" / "test.jsonl.gz", "rt") as f:
        row = json.loads(f.readline())
    p = pairs[0]
    assert p.prompt.endswith(HH_MARK) and p.prompt + p.chosen == row["chosen"]
    assert p.prompt + p.rejected == row["rejected"] and p.chosen != p.rejected
    assert p.prompt.count("\n\nHuman:") >= 1


def test_pairs_format_and_bad_rows(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"q": "2+2?", "good": " 4", "bad": " 5"}) + "\n")
    pairs, _ = load_pairs(f, "pairs", prompt_key="q", chosen_key="good", rejected_key="bad")
    assert (pairs[0].prompt, pairs[0].chosen, pairs[0].rejected) == ("2+2?", " 4", " 5")
    f.write_text(json.dumps({"q": "x", "good": None, "bad": "y"}) + "\n")
    with pytest.raises(RecipeError, match=r":1: key 'good' is null, not text"):
        load_pairs(f, "pairs", prompt_key="q", chosen_key="good", rejected_key="bad")
    f.write_text(json.dumps({"chosen": "no marker", "rejected": "other"}) + "\n")
    with pytest.raises(RecipeError, match="no usable preference pairs"):
        load_pairs(f, "hh")


def test_tokenize_keeps_prompt_end_and_reply_start(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    from posttrain.recipes.preference import PreferencePair

    pair = PreferencePair(0, "a" * 30 + "END", "xyz" * 20, "q")
    [t] = tokenize_pairs([pair], tok, max_length=24)
    assert len(t.prompt_ids) + len(t.chosen_ids) <= 24
    assert tok.decode(t.prompt_ids).endswith("END")
    assert tok.decode(t.chosen_ids).startswith("xyz")
    assert t.rejected_ids[-1] == tok.eos_token_id
