"""A tiny random Llama with a character-level tokenizer and a chat template, built
from a config in a few hundred milliseconds; no hub, no files shipped."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")


def build_tiny_model(
    folder: Path,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 32,
    max_positions: int = 512,
    *,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<pad>",
    extra_specials: tuple[str, ...] = (),
    generation_config: dict[str, Any] | None = None,
    arch: str = "llama",
    tied: bool = True,
    vocab_size: int | None = None,
) -> Path:
    """Write a transformers folder (config, safetensors, tokenizer) into `folder`.

    vLLM's CPU attention needs head_dim ≥ 32 (4 heads: hidden ≥ 128).

    Args:
        eos_token: the tokenizer's `eos_token` (and config.json's `eos_token_id`); the
            other chat tokens stay special tokens.
        pad_token: the tokenizer's `pad_token` (and config.json's `pad_token_id`); e.g.
            the EOS, as SmolLM2 ships it (pad = eos).
        extra_specials: more special tokens, appended after the characters (so the
            ids of the default vocabulary do not move): the k-th has id
            `len(SPECIALS) + len(CHARS) + k`.
        generation_config: keys written over the `generation_config.json` that
            `save_pretrained` writes (e.g. `{"repetition_penalty": 5.0}`).
        arch: 'llama', 'qwen2' (biases on q, k, v) or 'qwen3' (q and k norms).
        tied: the output layer shares the input embedding.
        vocab_size: rows of the embedding and the head (default: the tokenizer's
            tokens); more pad it, as Qwen2.5-7B's 152064 rows pad its 151665 tokens.
    """
    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    Config = getattr(transformers, f"{names[arch]}Config")
    Model = getattr(transformers, f"{names[arch]}ForCausalLM")

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS + list(extra_specials))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    others = [t for t in ("<|im_start|>", "<|im_end|>", *extra_specials) if t != eos_token]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token=pad_token,
        eos_token=eos_token,
        additional_special_tokens=others,
    )
    tok.chat_template = CHAT_TEMPLATE
    config = Config(
        vocab_size=vocab_size or len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        eos_token_id=vocab[eos_token],
        pad_token_id=vocab[pad_token],
        bos_token_id=None,
        **({"head_dim": hidden // 4} if arch == "qwen3" else {}),  # its default is 128
    )
    torch.manual_seed(seed)
    model = Model(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if generation_config:
        gen_file = folder / "generation_config.json"
        written = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        gen_file.write_text(json.dumps({**written, **generation_config}, indent=2))
    return folder
