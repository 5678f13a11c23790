"""Preference data: HH-RLHF splitting, the pairs format (text and chat messages),
tokenisation (raw text or the chat template, one BOS) and truncation."""

from __future__ import annotations

import gzip
import json

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from posttrain.config import RecipeError
from posttrain.recipes.data.pair_tokens import (
    CHAT_TEMPLATE_ID,
    PLAIN_BOS_TEMPLATE_ID,
    PLAIN_TEMPLATE_ID,
    tokenize_pairs,
    tokenize_pairs_with_template,
)
from posttrain.recipes.data.pairs import HH_MARK, PreferencePair, load_pairs
from tests.tiny_model import CHAT_TEMPLATE


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
    pair = PreferencePair(0, "a" * 30 + "END", "xyz" * 20, "q")
    [t] = tokenize_pairs([pair], tok, max_length=24)
    assert len(t.prompt_ids) + len(t.chosen_ids) <= 24
    assert tok.decode(t.prompt_ids).endswith("END")
    assert tok.decode(t.chosen_ids).startswith("xyz")
    assert t.rejected_ids[-1] == tok.eos_token_id


# Chat-format pairs: the model's chat template, as rollouts render prompts.

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def _with_bos(tiny_model, in_template: bool, auto_bos: bool):
    """A test-local copy of the tiny tokenizer with a BOS `<s>`: written by the chat
    template (`in_template`) and/or added to every encoding by the tokenizer (`auto_bos`)."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.chat_template = ("{{ bos_token }}" if in_template else "") + CHAT_TEMPLATE
    if auto_bos:
        tok._tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)]
        )
    return tok


def _template_ids(tok, messages):
    out = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def test_chat_pairs_load_as_messages(tmp_path):
    f = tmp_path / "chat.jsonl"
    row = {"prompt": CHAT, "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}
    f.write_text(json.dumps(row) + "\n")
    [p], _ = load_pairs(f, "pairs")
    assert p.is_chat and (p.prompt, p.chosen, p.rejected) == (CHAT, "4", "5")
    bad = [
        ({**row, "chosen": CHAT}, "must hold one assistant message"),
        ({**row, "prompt": "2+2?"}, "give the prompt as a list of messages"),
        ({**row, "prompt": [{"role": "user"}]}, "not text or a list of"),
    ]
    for r, msg in bad:
        f.write_text(json.dumps(r) + "\n")
        with pytest.raises(RecipeError, match=msg):
            load_pairs(f, "pairs")
    f.write_text(json.dumps(row) + "\n" + json.dumps({**row, "prompt": "x", "chosen": "y"}))
    with pytest.raises(RecipeError, match=r":2: .*changes shape"):
        load_pairs(f, "pairs")


def test_chat_pair_uses_the_chat_template_like_rollouts(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    pair = PreferencePair(0, CHAT, "4", "five")
    res = tokenize_pairs_with_template([pair], tok, max_length=256)
    [t] = res.pairs
    assert res.template_id == CHAT_TEMPLATE_ID and "chat template" in res.description
    assert t.prompt_ids == _template_ids(tok, CHAT)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert t.chosen_ids == tok("4", add_special_tokens=False)["input_ids"] + [end]
    assert tok.decode(t.prompt_ids + t.rejected_ids) == tok.apply_chat_template(
        CHAT + [{"role": "assistant", "content": "five"}], tokenize=False
    ).rstrip("\n")


@pytest.mark.parametrize("in_template,auto_bos", [(True, False), (True, True), (False, True)])
def test_chat_prompt_has_exactly_one_bos(tiny_model, in_template, auto_bos):
    tok = _with_bos(tiny_model, in_template, auto_bos)
    [t] = tokenize_pairs_with_template([PreferencePair(0, CHAT, "4", "5")], tok, 256).pairs
    assert t.prompt_ids.count(tok.bos_token_id) == 1 and t.prompt_ids[0] == tok.bos_token_id
    assert t.prompt_ids[1:] == [i for i in _template_ids(tok, CHAT) if i != tok.bos_token_id]
    if in_template:  # the template writes the BOS: exactly what rollouts send
        assert t.prompt_ids == _template_ids(tok, CHAT)
    assert tok.bos_token_id not in t.chosen_ids + t.rejected_ids


def test_truncated_chat_prompt_keeps_its_bos(tiny_model):
    tok = _with_bos(tiny_model, in_template=True, auto_bos=False)
    long = [{"role": "user", "content": "a" * 60 + "END"}]
    [t] = tokenize_pairs_with_template([PreferencePair(0, long, "x" * 40, "q")], tok, 48).pairs
    assert len(t.prompt_ids) + len(t.chosen_ids) <= 48 and t.prompt_ids[0] == tok.bos_token_id
    assert tok.decode(t.prompt_ids[1:], skip_special_tokens=True).endswith("END\nassistant\n")


def test_hh_pair_stays_raw_text(tiny_model):
    hh = PreferencePair(0, "\n\nHuman: 2+2?" + HH_MARK, " 4", " 5")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    res = tokenize_pairs_with_template([hh], tok, max_length=256)
    raw = tok(hh.prompt, add_special_tokens=False)["input_ids"]
    assert res.template_id == PLAIN_TEMPLATE_ID and "plain text" in res.description
    assert res.pairs == tokenize_pairs([hh], tok, max_length=256)
    assert res.pairs[0].prompt_ids == raw
    assert tok.convert_tokens_to_ids("<|im_start|>") not in res.pairs[0].prompt_ids
    # A tokenizer that puts BOS in front of its encodings gets one, and nothing else.
    bos_tok = _with_bos(tiny_model, in_template=True, auto_bos=True)
    res = tokenize_pairs_with_template([hh], bos_tok, max_length=256)
    assert res.template_id == PLAIN_BOS_TEMPLATE_ID
    assert res.pairs[0].prompt_ids == [bos_tok.bos_token_id] + raw
