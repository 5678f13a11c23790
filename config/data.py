"""Data blocks of a recipe (`data:`), pydantic only. The variant of `data.train` is
picked by its telltale key (`generator`, `format`, else a jsonl of prompts), so a
mistake is reported against that variant alone."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from .base import Strict as _Strict


class GeneratorData(_Strict):
    generator: Literal["arithmetic"] = Field(
        description="Procedural task: 'arithmetic' uses reasoning-gym's basic_arithmetic."
    )
    size: int = Field(2000, gt=0, description="Number of distinct problems generated.")
    seed: int = Field(0, description="Seed of the generator; same seed, same problems.")
    min_terms: int = Field(2, ge=2, description="Fewest operands per expression.")
    max_terms: int = Field(2, ge=2, description="Most operands per expression.")
    min_digits: int = Field(1, ge=1, description="Fewest digits per operand.")
    max_digits: int = Field(1, ge=1, description="Most digits per operand.")
    operators: list[Literal["+", "-", "*", "/"]] = Field(
        default_factory=lambda: ["+"], min_length=1, description="Operators drawn from."
    )

    @model_validator(mode="after")
    def _ranges(self) -> GeneratorData:
        if self.min_terms > self.max_terms:
            raise ValueError(
                f"min_terms ({self.min_terms}) is larger than max_terms ({self.max_terms}); "
                "set max_terms >= min_terms"
            )
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"min_digits ({self.min_digits}) is larger than max_digits ({self.max_digits}); "
                "set max_digits >= min_digits"
            )
        return self


class JsonlData(_Strict):
    path: str = Field(
        description="A .jsonl file (one JSON object per line), relative to the recipe file "
        "or absolute."
    )
    prompt_key: str = Field("question", description="Key of the prompt text in each row.")
    answer_key: str | None = Field(
        "answer",
        description="Key of the reference answer in each row; null when the rewards need "
        "none (e.g. code tests, which come from the row's other keys as metadata).",
    )
    answer_delimiter: str | None = Field(
        "####",
        description="If set, the ground truth is the text after the last occurrence of this "
        "delimiter in the answer (GSM8K puts the final number after '####').",
    )
    limit: int | None = Field(None, gt=0, description="Use only the first N rows.")


class PreferenceData(_Strict):
    path: str = Field(
        description="Preference pairs, .jsonl or .jsonl.gz, relative to the "
        "recipe file or absolute."
    )
    format: Literal["hh", "pairs"] = Field(
        description="hh: HH-RLHF rows {chosen, rejected} of whole dialogues, split into the "
        "shared prompt and the two last replies. pairs: rows with prompt, chosen, rejected."
    )
    prompt_key: str = Field("prompt", description="Key of the prompt (format: pairs).")
    chosen_key: str = Field("chosen", description="Key of the preferred reply or dialogue.")
    rejected_key: str = Field("rejected", description="Key of the other reply or dialogue.")
    limit: int | None = Field(None, gt=0, description="Use only the first N pairs.")


def _data_kind(v: Any) -> str:
    # Pick the variant by its telltale key, so errors speak about one variant only.
    if isinstance(v, dict):
        return "generator" if "generator" in v else "preference" if "format" in v else "jsonl"
    return {GeneratorData: "generator", PreferenceData: "preference"}.get(type(v), "jsonl")


class DataConfig(_Strict):
    train: Annotated[
        Annotated[GeneratorData, Tag("generator")]
        | Annotated[JsonlData, Tag("jsonl")]
        | Annotated[PreferenceData, Tag("preference")],
        Discriminator(_data_kind),
    ] = Field(
        description="GRPO: {generator: arithmetic, ...} or {path: data.jsonl, prompt_key, "
        "answer_key}. DPO: {path: pairs.jsonl[.gz], format: hh | pairs, ...}."
    )
    shuffle_seed: int = Field(0, description="Seed of the order prompts are drawn in.")


__all__ = ["DataConfig", "GeneratorData", "JsonlData", "PreferenceData"]
