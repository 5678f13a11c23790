"""The sizes of a decoder-only Llama-style model, read from its config.json (decoder
layers of attention with grouped KV heads and a gated MLP): what `posttrain plan`
counts parameters, FLOPs and KV-cache bytes from. Nothing here imports torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import formulas as plan


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only Llama-style model (config.json names)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, path: Path) -> ModelShape:
        """Read `config.json` (or its `text_config`); KeyError names a missing key."""
        cfg = json.loads(path.read_text())
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        heads = cfg["num_attention_heads"]
        return cls(
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by module name."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def params(self) -> int:
        """Parameters: embeddings (twice unless tied), linear layers, RMSNorm weights."""
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + self.layers * per_layer + self.hidden

    def lora_params(self, r: int, targets: list[str]) -> int:
        """LoRA parameters: r·(in + out) per targeted linear layer (Hu et al. 2021, §4)."""
        shapes = self.linear_shapes()
        return self.layers * sum(r * sum(shapes[t]) for t in targets if t in shapes)

    def kv_bytes_per_token(self) -> float:
        """KV cache bytes per token in bf16."""
        return plan.kv_cache_bytes(self.layers, self.kv_heads, self.head_dim, 1)
