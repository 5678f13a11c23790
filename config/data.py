"""Data blocks of a recipe (`data:` and `eval.prompts`), pydantic only.

A source is one of: a procedural task (`generator: arithmetic`), a reasoning-gym dataset
by name (`reasoning_gym: NAME`), or a file or folder (`path:`) in any layout the field
uses (verl's RL parquet, TRL's prompt / prompt-completion / preference / messages
datasets, HH-RLHF dialogues, a plain column of prompts). `data.train` is one source or
a weighted `mixture` of them. The variant is picked by its telltale key (`generator`,
`reasoning_gym`, `mixture`, else `path`), so a mistake is reported against that variant
alone. Reading the rows is recipes/data/rows.py and recipes/data/layouts.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from .base import Strict as _Strict
from .env_data import EnvironmentData

#: Distinct problems of `generator: python_functions` (recipes/data/tasks/functions.py; a
#: test checks the two agree: the schema imports no task code).
PYTHON_FUNCTIONS = 408

#: Most problems one generated source (`generator`, `reasoning_gym`) or a mixture's
#: `size` may ask for. Every problem is made and held in memory by `validate` and again by
#: `run` before the first step (about 50 µs and 1.5 KB each on a 2-core CPU: 10^6 takes
#: about a minute and 1.5 GB), and 10^6 is more than a run draws (1,000 steps of 1,000
#: prompts); 10^9 would need 1.5 TB.
MAX_GENERATED = 1_000_000
#: Most rollouts one step (train.prompts_per_step × rollout.samples_per_prompt) or one
#: evaluation (eval.k × its prompts) may draw: 100x a large GPU step's 512 × 16; 10^9
#: would queue requests and hold rows until memory ran out.
MAX_SAMPLES = 1_000_000

#: Most operands (`max_terms`) and digits per operand (`max_digits`) of generator
#: arithmetic: reasoning-gym computes 10**digits per operand and the prompt holds
#: terms × digits characters (100 × 100 is about 10^4 characters, past most contexts'
#: use for arithmetic).
MAX_TERMS, MAX_DIGITS = 100, 100
#: Python turns no integer of more than 4300 digits into text (sys.get_int_max_str_digits),
#: and a product of max_terms operands has up to max_terms × max_digits digits.
MAX_PRODUCT_DIGITS = 4000
#: reasoning-gym's "/" looks for a divisor by trying every number below 10**digits: at 5
#: digits about 2 ms a problem, at 6 about 20 ms, at 7 about 250 ms (8 minutes for 2000).
MAX_DIVISION_DIGITS = 5


def _size_limit(size: int | None, what: str) -> int | None:
    """A generated `size` is at most `MAX_GENERATED` (its comment says why)."""
    if size is not None and size > MAX_GENERATED:
        raise ValueError(
            f"size is {size:,}, more than the {MAX_GENERATED:,} problems {what} may make: "
            "every problem is generated and held in memory before training starts (about "
            "1.5 KB each; 10^6 is about a minute and 1.5 GB), and a run draws "
            "train.steps × train.prompts_per_step prompts; set size: "
            f"{MAX_GENERATED:,} or less"
        )
    return size


class _Source(_Strict):
    """Keys every source has."""

    weight: float = Field(
        1.0,
        gt=0,
        description="Inside data.train.mixture: this source's share of the mixture, "
        "weight / (sum of the weights); must be > 0. When no source of the mixture "
        "sets one, the weights are the sources' row counts. Not read elsewhere.",
    )
    data_source: str | None = Field(
        None,
        description="The `data_source` of this source's rows (where a row has no "
        "`data_source` column of its own); reward components with `sources:` apply to "
        "the rows whose data_source they name. reasoning_gym: default the dataset name.",
    )


class GeneratorData(_Source):
    generator: Literal["arithmetic", "tool_chats", "python_functions"] = Field(
        description="Procedural task: 'arithmetic' uses reasoning-gym's basic_arithmetic. "
        "'python_functions': short Python functions to write (a signature and docstring; "
        "scored by the code reward against five asserts; recipes/data/tasks/functions.py; "
        "`size` and `seed` only). "
        "'tool_chats' (algorithm: sft only) turns the same problems into tool-use "
        "conversations: system prompt (model.system_prompt), question, a python "
        "<tool_call>, its output as a tool message, the final number."
    )
    size: int = Field(
        2000,
        gt=0,
        strict=True,
        description=f"Number of problems generated (at most {MAX_GENERATED:,}).",
    )
    seed: int = Field(0, description="Seed of the generator; same seed, same problems.")
    min_terms: int = Field(2, ge=2, strict=True, description="Fewest operands per expression.")
    max_terms: int = Field(
        2,
        ge=2,
        le=MAX_TERMS,
        strict=True,
        description=f"Most operands per expression (at most {MAX_TERMS}).",
    )
    min_digits: int = Field(1, ge=1, strict=True, description="Fewest digits per operand.")
    max_digits: int = Field(
        1,
        ge=1,
        le=MAX_DIGITS,
        strict=True,
        description="Most digits per operand: reasoning-gym draws a d-digit problem's "
        "operands from 0 to 10**d inclusive (2 gives 0..100) "
        f"(at most {MAX_DIGITS}; with '/' at most "
        f"{MAX_DIVISION_DIGITS}; with '*' max_terms × max_digits at most "
        f"{MAX_PRODUCT_DIGITS}).",
    )
    operators: list[Literal["+", "-", "*", "/"]] = Field(
        default_factory=lambda: ["+"], min_length=1, description="Operators drawn from."
    )

    @field_validator("size")
    @classmethod
    def _size(cls, v: int, info: ValidationInfo) -> int | None:
        return _size_limit(v, f"generator {info.data.get('generator')}")

    @model_validator(mode="after")
    def _ranges(self) -> GeneratorData:
        if self.generator == "python_functions":
            return self._functions_only()
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
        return self._operator_limits()

    def _operator_limits(self) -> GeneratorData:
        """What reasoning-gym's basic_arithmetic can make in reasonable time and print."""
        if "/" in self.operators and self.max_digits > MAX_DIVISION_DIGITS:
            raise ValueError(
                f"max_digits is {self.max_digits} with operator '/': reasoning-gym finds "
                "each divisor by trying every number below 10**max_digits (at 6 digits about "
                "20 ms a problem, at 7 about 250 ms); set max_digits: "
                f"{MAX_DIVISION_DIGITS} or less, or leave '/' out of operators"
            )
        digits = self.max_terms * self.max_digits
        if "*" in self.operators and digits > MAX_PRODUCT_DIGITS:
            raise ValueError(
                f"max_terms × max_digits is {digits} with operator '*': a product of "
                f"{self.max_terms} operands of {self.max_digits} digits has up to {digits} "
                "digits, and Python prints no integer of more than 4300; make "
                f"max_terms × max_digits {MAX_PRODUCT_DIGITS} or less"
            )
        return self

    def _functions_only(self) -> GeneratorData:
        """python_functions takes `size` (at most its distinct problems) and `seed` only."""
        arithmetic = {"min_terms", "max_terms", "min_digits", "max_digits", "operators"}
        given = sorted(arithmetic & self.model_fields_set)
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to generator: arithmetic only; python_functions "
                "takes size and seed: remove them"
            )
        if self.size > PYTHON_FUNCTIONS:
            raise ValueError(
                f"size is {self.size}, but python_functions has {PYTHON_FUNCTIONS} distinct "
                f"problems (recipes/data/tasks/functions.py); set size: {PYTHON_FUNCTIONS} or less "
                "(a held-out set made from it is left out of training)"
            )
        return self


class ReasoningGymData(_Source):
    reasoning_gym: str = Field(
        description="A reasoning-gym dataset by its registered name (leg_counting, "
        "basic_arithmetic, ...; about 100: sorted(reasoning_gym.factory.DATASETS)). Each "
        "row's question is the prompt and its answer the ground truth; score it with a "
        "`type: reasoning_gym` reward (the dataset's own score_answer)."
    )
    size: int = Field(
        1000,
        gt=0,
        strict=True,
        description=f"Number of problems generated (at most {MAX_GENERATED:,}).",
    )
    seed: int = Field(0, description="Seed of the generator; same seed, same problems.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Other settings of the dataset's config class, passed to "
        "reasoning_gym.create_dataset (e.g. {min_animals: 3, max_animals: 5}).",
    )

    @field_validator("size")
    @classmethod
    def _size(cls, v: int, info: ValidationInfo) -> int | None:
        return _size_limit(v, f"reasoning_gym {info.data.get('reasoning_gym')}")

    @property
    def source_name(self) -> str:
        """The rows' data_source: `data_source`, else the dataset name."""
        return self.data_source or self.reasoning_gym


class FileData(_Source):
    path: str = Field(
        description="A file or folder, relative to the recipe file or absolute: .jsonl, "
        ".jsonl.gz, .json (JSON lines or one list of rows), .parquet, .csv, a folder of "
        "parquet shards (train-00000-of-00002.parquet, or verl's train.parquet / "
        "test.parquet: `split` picks), or a folder written by Hugging Face datasets' "
        "save_to_disk. Read locally; nothing is downloaded."
    )
    format: Literal["auto", "hh", "pairs"] = Field(
        "auto",
        description="auto: the layout is read from the columns: verl's RL rows (`prompt` "
        "messages, `data_source`, `reward_model.ground_truth`, `extra_info`), TRL's "
        "`prompt` (text or messages) with or without `completion`, `chosen`/`rejected` "
        "with or without a shared `prompt`, `messages`, or a text prompt under "
        "prompt_key. hh: Anthropic HH-RLHF rows {chosen, rejected} of whole dialogues, "
        "split into the shared prompt and the two last replies. pairs: as auto (kept for "
        "older recipes).",
    )
    split: str | None = Field(
        None,
        description="Which split of a save_to_disk DatasetDict or of a folder of shards "
        "named by split (train, test, validation, ...); default 'train', or the only one.",
    )
    prompt_key: str = Field(
        "auto",
        description="Key of the prompt: text, or chat messages [{role, content}] (a "
        "system message among them replaces model.system_prompt for that row). auto: "
        "'prompt', else 'messages' (its last assistant turn is dropped), else the shared "
        "start of 'chosen'/'rejected', else 'question'.",
    )
    answer_key: str | None = Field(
        "auto",
        description="Key of the reference answer (a dotted path reaches into a mapping: "
        "reward_model.ground_truth); null when the rewards need none (e.g. code tests). "
        "auto: the first of reward_model.ground_truth, answer, ground_truth, solution, "
        "completion (and a `messages` row's last assistant turn) that row 1 has.",
    )
    answer_delimiter: str | None = Field(
        "####",
        description="If set, the ground truth is the text after the last occurrence of this "
        "delimiter in the answer (GSM8K puts the final number after '####').",
    )
    system_key: str | None = Field(
        None,
        description="Key of a per-row system message (text); it replaces "
        "model.system_prompt for that row.",
    )
    chosen_key: str = Field("chosen", description="Key of the preferred reply or dialogue.")
    rejected_key: str = Field("rejected", description="Key of the other reply or dialogue.")
    limit: int | None = Field(
        None, gt=0, strict=True, description="Use only the first N rows (pairs)."
    )


# Older names of the file block (a jsonl of prompts; preference pairs).
JsonlData = FileData
PreferenceData = FileData


def _data_kind(v: Any) -> str:
    # Pick the variant by its telltale key, so errors speak about one variant only.
    if isinstance(v, dict):
        for key in ("generator", "reasoning_gym", "mixture", "environment"):
            if key in v:
                return key
        return "file"
    return {
        GeneratorData: "generator",
        ReasoningGymData: "reasoning_gym",
        MixtureData: "mixture",
        EnvironmentData: "environment",
    }.get(type(v), "file")


Source = Annotated[
    Annotated[GeneratorData, Tag("generator")]
    | Annotated[ReasoningGymData, Tag("reasoning_gym")]
    | Annotated[FileData, Tag("file")]
    | Annotated[EnvironmentData, Tag("environment")],
    Discriminator(_data_kind),
]


class MixtureData(_Strict):
    mixture: list[Source] = Field(
        min_length=1,
        description="Sources mixed by `weight`: an epoch holds `size` prompts (or pairs), "
        "source i's share weight_i / sum(weights) of them, drawn from its rows in a "
        "seeded order (a source with fewer rows than its share repeats them). Each "
        "source's own `limit` caps the rows it reads.",
    )
    size: int | None = Field(
        None,
        gt=0,
        strict=True,
        description="Items per epoch of the mixture; default: all the sources' rows (at "
        f"most {MAX_GENERATED:,}).",
    )
    seed: int = Field(0, description="Seed of which rows each source gives.")

    @field_validator("size")
    @classmethod
    def _size(cls, v: int | None) -> int | None:
        return _size_limit(v, "a mixture")

    @model_validator(mode="after")
    def _generated(self) -> MixtureData:
        made = sum(getattr(s, "size", 0) for s in self.mixture if not isinstance(s, FileData))
        if made > MAX_GENERATED:
            raise ValueError(
                f"the mixture's generated sources make {made:,} problems together, more "
                f"than {MAX_GENERATED:,} (every one is made and held in memory before "
                "training starts, about 1.5 KB each); lower their sizes to "
                f"{MAX_GENERATED:,} or less in all"
            )
        return self


TrainSource = Annotated[
    Annotated[GeneratorData, Tag("generator")]
    | Annotated[ReasoningGymData, Tag("reasoning_gym")]
    | Annotated[FileData, Tag("file")]
    | Annotated[MixtureData, Tag("mixture")]
    | Annotated[EnvironmentData, Tag("environment")],
    Discriminator(_data_kind),
]


def sources_of(block: Any) -> list[Any]:
    """The single sources of a data block (a mixture's entries, else the block)."""
    return list(block.mixture) if isinstance(block, MixtureData) else [block]


def check_weights_in_mixtures(block: Any, key: str) -> None:
    """`weight` means something only inside a mixture.

    Raises:
        ValueError: a single source sets `weight`.
    """
    if not isinstance(block, MixtureData) and "weight" in block.model_fields_set:
        raise ValueError(
            f"{key}.weight acts only inside a mixture; remove it, or list the sources "
            f"under {key}.mixture"
        )


class DataConfig(_Strict):
    train: TrainSource = Field(
        description="One source or a mixture. GRPO / PPO prompts: {generator: arithmetic, "
        "...}, {reasoning_gym: NAME, ...}, {path: FILE_OR_FOLDER, ...} or {mixture: "
        "[source, ...]}. DPO / reward model pairs: {path: ..., format: auto | hh} (or a "
        "mixture of such files)."
    )
    shuffle_seed: int = Field(0, description="Seed of the order prompts are drawn in.")
    heldout: TrainSource | None = Field(
        None,
        description="DPO / reward model: held-out preference pairs ({path: ..., format: "
        "hh | auto}, limit as in data.train), never trained on: training pairs whose "
        "prompt equals a held-out one are left out. A reward model scores them during "
        "training (instead of splitting reward_model.eval_pairs off data.train); "
        "`posttrain eval` and bench/learning.py report on them. GRPO / PPO hold out "
        "prompts with `eval:` instead.",
    )

    @model_validator(mode="after")
    def _weights(self) -> DataConfig:
        check_weights_in_mixtures(self.train, "data.train")
        if self.heldout is not None:
            check_weights_in_mixtures(self.heldout, "data.heldout")
        return self


__all__ = [
    "DataConfig",
    "FileData",
    "GeneratorData",
    "JsonlData",
    "MixtureData",
    "PreferenceData",
    "ReasoningGymData",
    "Source",
    "TrainSource",
    "sources_of",
]
