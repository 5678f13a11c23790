"""`stop_token_ids`: the one place both engines get the tokens that end a sample."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from posttrain.actors.engine import end_of_turn_token_id, stop_token_ids
from tests.tiny_model import CHARS, SPECIALS, build_tiny_model

EXTRA = len(SPECIALS) + len(CHARS)  # id of the first extra special token
IM_END = SPECIALS.index("<|im_end|>")


def test_tokenizer_eos_and_generation_config_eos_both_stop(tmp_path):
    """The issue's model: tokenizer eos `<|im_end|>`, generation_config.json eos another
    id; the HF engine used to stop on the latter only."""
    folder = build_tiny_model(
        tmp_path / "m", extra_specials=("<|endoftext|>",), generation_config={"eos_token_id": EXTRA}
    )
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token_id == IM_END
    assert stop_token_ids(tok, str(folder)) == [IM_END, EXTRA]


def test_end_of_turn_of_the_chat_template_stops(tmp_path):
    folder = build_tiny_model(
        tmp_path / "m",
        eos_token="<|endoftext|>",
        extra_specials=("<|endoftext|>",),
        generation_config={"eos_token_id": [EXTRA]},
    )
    tok = AutoTokenizer.from_pretrained(folder)
    assert end_of_turn_token_id(tok) == IM_END
    assert stop_token_ids(tok, str(folder)) == [IM_END, EXTRA]


def test_templates_without_a_special_end_of_turn(tmp_path):
    folder = build_tiny_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_token_id(tok) is None  # plain text after the turn
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    assert end_of_turn_token_id(tok) is None
    tok.chat_template = None
    assert end_of_turn_token_id(tok) is None
    assert stop_token_ids(tok, str(folder)) == [IM_END]


def test_no_end_of_sequence_token_is_an_error(tmp_path):
    folder = build_tiny_model(tmp_path / "m", generation_config={"eos_token_id": None})
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template, tok.eos_token = None, None
    with pytest.raises(ValueError, match="names an end-of-sequence token"):
        stop_token_ids(tok, str(folder))
