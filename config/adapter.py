"""The `model.adapter:` block of a recipe (LoRA, QLoRA, DoRA), pydantic only.

Which way it travels: recipe → controller → `learner.adapters.AdapterSettings` (plain
values) on every learner rank. Names of target modules are checked against the real
model by the learner before any weights load (`learner.adapters.check_targets`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Strict as _Strict

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterConfig(_Strict):
    """A parameter-efficient adapter on the policy, trained through `peft`.

    LoRA (Hu et al. 2021, eq. 3): each targeted linear layer computes
    `h = W0 x + (alpha / r) * B A x` with `W0` frozen and only `A [r, in]`, `B [out, r]`
    trained. QLoRA (Dettmers et al. 2023, §3) also stores `W0` in 4-bit NormalFloat with
    double-quantised block scales and computes in `model.dtype`. The reference model (KL,
    DPO) is then the same weights with the adapter switched off: no second copy.
    """

    type: Literal["none", "lora", "qlora"] = Field(
        "none",
        description="'none': full fine-tuning; 'lora': LoRA adapters on a frozen base kept in "
        "model.dtype; 'qlora': LoRA on a frozen base stored in NF4 (4-bit, double-quantised "
        "scales).",
    )
    r: int = Field(16, gt=0, le=1024, description="LoRA rank r (rows of A, columns of B).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch's input while training."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="Names (last path component) of the linear layers that get adapters; the "
        "default is every attention and MLP projection of Llama-style models.",
    )
    use_dora: bool = Field(
        False,
        description="DoRA (Liu et al. 2024): also learn a per-output-channel magnitude. "
        "LoRA only (not with qlora).",
    )
    save_merged: bool = Field(
        False,
        description="The final checkpoint holds the adapter (PEFT format); also write "
        "the merged full model to FINAL/merged with save_pretrained. For qlora that is "
        "the policy as trained: the NF4-dequantised base plus the adapter (merge the "
        "adapter into the original base yourself for a model without quantisation error).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AdapterConfig:
        if self.type == "none":
            extra = sorted(self.model_fields_set - {"type"})
            if extra:
                raise ValueError(
                    f"{extra[0]} is set but type is 'none' (full "
                    "fine-tuning); set type: lora or qlora, or remove it"
                )
            return self
        bad = [t for t in self.target_modules if not t.replace("_", "a").isalnum()]
        if bad:
            raise ValueError(
                f"target_modules: {bad[0]!r} is not a module name; give the last "
                "path component of linear layers, e.g. q_proj"
            )
        dup = sorted({t for t in self.target_modules if self.target_modules.count(t) > 1})
        if dup:
            raise ValueError(f"target_modules: {dup} repeat; list each name once")
        if self.use_dora and self.type == "qlora":
            raise ValueError(
                "use_dora: DoRA needs the base weight's column norms every step, "
                "which peft cannot compute on an NF4 (torchao) base; use type: lora with "
                "use_dora, or qlora without it"
            )
        return self


def tied_head_problem(
    target_modules: list[str] | tuple[str, ...], tied: bool, model: str
) -> str | None:
    """Why a LoRA on `lm_head` cannot train `model` when its output layer is tied to its
    input embedding (`tie_word_embeddings`), or None when that is not the case.

    A LoRA there changes the head and not the embedding: the merged model would have to
    be untied, which a weight push into an engine serving the tied model cannot do (its
    head *is* the embedding), so merged pushes and `save_merged` would give another model.
    """
    if not tied or "lm_head" not in target_modules:
        return None
    return (
        f"model.adapter.target_modules: 'lm_head' on {model}, whose lm_head shares its "
        "weights with the input embedding (tie_word_embeddings: true): a LoRA there would "
        "change the head but not the embedding, which the tied model the engines serve "
        "cannot hold; remove 'lm_head' from model.adapter.target_modules, or train a copy "
        "of the model saved with tie_word_embeddings: false"
    )
