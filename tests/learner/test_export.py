"""A saved policy keeps the source model's generation config and tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from posttrain.learner.export import carry_model_files, differing_model_files
from tests.tiny_model import build_tiny_model

#: generation_config.json as instruct models ship it (several stop ids, sampling
#: defaults); in the tiny vocabulary 3 is <|im_end|> (config.json's eos) and 2 <|im_start|>.
HUB_GENERATION_CONFIG = {
    "eos_token_id": [3, 2],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
}


@pytest.fixture(scope="module")
def hub_like_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with exactly `HUB_GENERATION_CONFIG` as its generation_config.json."""
    folder = build_tiny_model(tmp_path_factory.mktemp("hub") / "model")
    (folder / "generation_config.json").write_text(json.dumps(HUB_GENERATION_CONFIG))
    return folder


def _save_like_worker(source: Path, dest: Path) -> None:
    # What learner/worker.py `_save_full` + `save_checkpoint` do: a plain model from the
    # config, save_pretrained, then the tokenizer re-saved.
    config = AutoConfig.from_pretrained(source)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.save_pretrained(dest)
    AutoTokenizer.from_pretrained(source).save_pretrained(dest)


def test_plain_save_loses_generation_config_and_carry_restores_it(hub_like_model, tmp_path):
    dest = tmp_path / "final"
    _save_like_worker(hub_like_model, dest)
    lost = GenerationConfig.from_pretrained(dest)  # the old behaviour
    assert lost.eos_token_id == 3 and lost.temperature in (None, 1.0) and lost.top_p in (None, 1.0)
    assert "generation_config.json" in differing_model_files(hub_like_model, dest)

    copied = carry_model_files(hub_like_model, dest)

    assert "generation_config.json" in copied and "tokenizer_config.json" in copied
    assert not any(n.endswith(".safetensors") or n == "config.json" for n in copied)
    gen = GenerationConfig.from_pretrained(dest)
    assert gen.eos_token_id == [3, 2] and gen.temperature == 0.6 and gen.top_p == 0.95
    assert json.loads((dest / "generation_config.json").read_text()) == HUB_GENERATION_CONFIG
    assert differing_model_files(hub_like_model, dest) == []
    src_tok, out_tok = (AutoTokenizer.from_pretrained(p) for p in (hub_like_model, dest))
    msgs = [{"role": "user", "content": "2+2?"}]
    assert out_tok("Hi there!")["input_ids"] == src_tok("Hi there!")["input_ids"]
    assert out_tok.chat_template == src_tok.chat_template
    assert out_tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    ) == src_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out_tok.eos_token_id == src_tok.eos_token_id


def test_carry_into_adapter_folder_never_copies_weights_or_config(hub_like_model, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in (
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "adapter_config.json",
        "README.md",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "tokenizer.model",
        "tokenization_custom.py",
    ):
        (src / name).write_text(name)
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("t")
    dest = tmp_path / "adapter"
    dest.mkdir()
    (dest / "adapter_config.json").write_text("mine")
    (dest / "tokenizer.json").write_text("stale")

    copied = carry_model_files(src, dest)

    assert copied == [
        "additional_chat_templates/tool_use.jinja",
        "chat_template.jinja",
        "generation_config.json",
        "merges.txt",
        "special_tokens_map.json",
        "tokenization_custom.py",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert (dest / "tokenizer.json").read_text() == "tokenizer.json"
    assert (dest / "adapter_config.json").read_text() == "mine"
    assert not (dest / "config.json").exists() and not list(dest.glob("*.safetensors*"))
    assert carry_model_files(src, src) == []
    with pytest.raises(FileNotFoundError, match="not a folder"):
        carry_model_files(tmp_path / "missing", dest)
