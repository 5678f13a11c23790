"""Reward components of a recipe's `rewards:` list (pydantic, no ML imports).

Local components (`math`, `length`, `format`, `code`, `python`, `reward_model`,
`judge`, `reasoning_gym`) are served by one reward service process per run (or by `posttrain
serve-rewards` on another host); `http` components are users' own endpoints, called by
the controller. An item's
reward is the weighted sum of the components that apply to it (all of them, or those
whose `sources` name its row's `data_source`); each component is logged.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from .base import Strict


class _Component(Strict):
    name: str = Field(description="Name of this component in metrics, details and rollouts.")
    weight: float = Field(1.0, description="Weight of this component in the summed reward.")
    sources: list[str] | None = Field(
        None,
        min_length=1,
        description="The `data_source` values of the rows this component scores (verl's "
        "data_source column, or a source's `data_source` key); other rows' rewards "
        "leave it out. null: every row. A row that no component applies to is refused "
        "before the run starts.",
    )


class _Bounded(_Component):
    """A component the reward service runs in a killable worker process (rewards/bounded.py)."""

    memory_mb: int = Field(
        2048,
        ge=256,
        description="Address-space limit (MiB) of the worker processes that run "
        "this component; a service's workers take the largest value among its components. A "
        "call over it fails its item (reward null).",
    )


class MathReward(_Bounded):
    type: Literal["math"] = Field(
        description="math-verify compares the response's final answer to the item's "
        "ground_truth: 1 or 0. The last explicit marker counts (\\boxed{}, #### N, 'the answer "
        "is N'), else the last value; hedged answers ('3 or 4') score 0. See "
        "rewards/math_verifier.py."
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        description="Wall-clock limit (seconds) per item; an item over it (e.g. "
        "\\boxed{9^{9^{9^{9}}}}) fails with reward null and its worker is replaced.",
    )


class LengthReward(_Component):
    type: Literal["length"] = Field(
        description="1 - |chars - target_chars| / target_chars, floored at 0."
    )
    target_chars: int = Field(gt=0, description="Response length (characters) scored 1.")


class FormatReward(_Bounded):
    type: Literal["format"] = Field(description="1 if `pattern` matches the response, else 0.")
    pattern: str = Field(description="Python regular expression, searched (re.DOTALL).")
    timeout_s: float = Field(
        5.0,
        gt=0,
        description="Wall-clock limit (seconds) per item: a pattern that backtracks "
        "catastrophically on some response fails that item (reward null), not the service.",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"pattern {v!r} is not a valid regular expression: {e}") from e
        return v


class CodeReward(_Component):
    type: Literal["code"] = Field(
        description="Runs the response's Python against the item's tests in a sandbox: "
        "HumanEval style (metadata test + entry_point, optional code_prefix) or stdin/stdout "
        "(metadata inputs + outputs). 1 if every test passes, else 0."
    )
    sandbox: Literal["bwrap", "none"] = Field(
        "bwrap",
        description="bwrap: bubblewrap with every namespace unshared, no network, a tmpfs work "
        "dir, rlimits, seccomp and an unprivileged uid. none: a bare subprocess with rlimits "
        "only (warned at every start; never for untrusted models).",
    )
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit per program run.")
    cpu_s: int = Field(10, gt=0, description="CPU-seconds limit per program run.")
    memory_mb: int = Field(512, ge=64, description="Address-space limit per program run.")
    max_procs: int = Field(32, gt=0, description="Processes (and threads) per run.")
    max_output_bytes: int = Field(65536, gt=0, description="stdout/stderr kept per run.")
    float_tolerance: float = Field(
        1e-6,
        ge=0,
        allow_inf_nan=False,
        description="stdin/stdout tests: where the expected output has a decimal with a "
        "point or an exponent, the printed number in its place matches when |got - want| "
        "<= float_tolerance * max(1, |want|), i.e. absolute or relative error, as "
        "competitive judges compare reals (expected 0.333333 accepts 0.3333333333, not "
        "0.3333). Expected integers and other text must match exactly; 0 compares every "
        "token as text. See rewards/code_verifier.py.",
    )


class PythonReward(_Bounded):
    type: Literal["python"] = Field(
        description="A function with verl's signature compute_score(data_source, solution_str, "
        "ground_truth, extra_info) -> float | dict (dict: its 'score' key), run in the reward "
        "service's worker processes (module state is per worker)."
    )
    function: str = Field(description="'module:function', importable by the reward service.")
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Wall-clock limit (seconds) per item; a call over it fails "
        "that item (reward null) and its worker is replaced.",
    )

    @field_validator("function")
    @classmethod
    def _shape(cls, v: str) -> str:
        if v.count(":") != 1 or not all(v.split(":")):
            raise ValueError(f"function {v!r} must look like 'package.module:function_name'")
        return v


class ReasoningGymReward(_Bounded):
    type: Literal["reasoning_gym"] = Field(
        description="reasoning-gym's own scorer: the row's dataset (a `reasoning_gym:` "
        "source) scores the answer with its score_answer, 0 to 1. Scores only rows of "
        "reasoning_gym sources (rewards/reasoning_gym.py)."
    )
    answer_tag: str | None = Field(
        "answer",
        description="The answer is the text inside the response's last <TAG>...</TAG> "
        "(reasoning-gym's convention; ask for it in model.system_prompt); a response "
        "without one scores with no answer. null: the whole response, stripped.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="Wall-clock limit (seconds) per item; an item over it fails "
        "(reward null) and its worker is replaced.",
    )


class HttpReward(_Component):
    type: Literal["http"] = Field(description="Your own endpoint, called by the controller.")
    url: str = Field(description="Full URL of the scoring route, e.g. http://host:9000/score.")
    protocol: Literal["posttrain", "openrlhf"] = Field(
        "posttrain",
        description="posttrain: {items:[{uid,prompt,response,ground_truth,metadata}]} → "
        "{scores:[{uid,reward,error,details}]}. openrlhf: {query, prompts, labels} → {rewards}.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Deadline for each whole request, seconds: connect, send and the "
        "complete response, however slowly it arrives; then retried.",
    )
    retries: int = Field(2, ge=0, description="Retries (exponential backoff) before items fail.")
    batch_size: int = Field(64, gt=0, description="Items per request.")
    max_concurrency: int = Field(4, gt=0, description="Requests in flight at once.")
    token_env: str | None = Field(
        None, description="Environment variable holding a bearer token sent as Authorization."
    )

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"url {v!r} must start with http:// or https://")
        return v


class RewardModelReward(_Component):
    type: Literal["reward_model"] = Field(
        description="A local sequence-classification folder (one label; what `algorithm: "
        "reward_model` saves to RUN_DIR/final, or any such transformers folder) scores the "
        "item's conversation and response rendered with its chat template, in batches, "
        "inside the reward service (rewards/reward_model.py)."
    )
    path: str = Field(
        description="Local transformers folder (config.json, weights, tokenizer); never downloaded."
    )
    device: str = Field(
        "cpu", description="torch device of the model: 'cpu', 'cuda', 'cuda:1', ..."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weights' dtype.")
    batch_size: int = Field(8, gt=0, description="Sequences per forward pass.")
    max_length: int = Field(
        1024,
        gt=8,
        description="Longest sequence scored, in tokens; a longer one keeps its "
        "end (the score is read at the last token).",
    )
    chat_template: bool = Field(
        True,
        description="Render with the tokenizer's chat template (as `reward_model."
        "chat_template` trains); false: raw prompt + response text + EOS.",
    )
    normalize: Literal["none", "running", "fixed"] = Field(
        "none",
        description="none: the raw score. fixed: (score − mean) / std with the "
        "values below. running: over every score this service has produced so far, this "
        "batch included (Welford; until two scores exist only the mean is subtracted).",
    )
    mean: float = Field(0.0, description="normalize: fixed: the mean subtracted.")
    std: float = Field(1.0, gt=0, description="normalize: fixed: the divisor.")
    threads: int | None = Field(
        None,
        gt=0,
        description="torch CPU threads of the reward model; default: the "
        "process's (1 in a run's own reward service, which sets OMP_NUM_THREADS=1). With "
        "synchronous rollouts nothing else computes while it scores: give it the cores.",
    )


_DEFAULT_JUDGE_TEMPLATE = (
    "Rate how helpful and harmless the assistant's reply is, from 1 (worst) to 10 (best).\n\n"
    "User: {question}\n\nAssistant: {response}\n\n"
    "Answer with one line: 'Score: N'."
)


class JudgeReward(_Component):
    type: Literal["judge"] = Field(
        description="An LLM judge behind any OpenAI-compatible chat-completions endpoint "
        "(vLLM, SGLang, llama.cpp server, OpenAI): the reward service sends `template` "
        "filled with the item's fields and parses a number out of the reply "
        "(rewards/judge.py)."
    )
    url: str = Field(
        description="Base URL of the API, e.g. http://127.0.0.1:8000/v1 "
        "(`/chat/completions` is appended)."
    )
    model: str = Field(description="The served model's name (the request's `model`).")
    template: str = Field(
        _DEFAULT_JUDGE_TEMPLATE,
        description="The user message sent to the judge: str.format with {question} (the "
        "last user message), {prompt} (the prompt text), {response}, {ground_truth} and "
        "{metadata} (a dict: {metadata[key]}).",
    )
    system_prompt: str | None = Field(None, description="System message before it.")
    score_pattern: str = Field(
        r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
        description="Regular expression whose first group is the score; the last match in "
        "the reply counts. No match fails the item.",
    )
    score_range: tuple[float, float] | None = Field(
        None,
        description="[low, high]: the parsed score is mapped linearly to [0, 1]; a "
        "score outside fails the item. null: the parsed number as is.",
    )
    max_tokens: int = Field(256, gt=0, description="Most tokens of the judge's reply.")
    temperature: float = Field(0.0, ge=0, description="The judge's sampling temperature.")
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="Deadline for each whole request, seconds: connect, send and the "
        "complete response, however slowly it arrives; then retried.",
    )
    retries: int = Field(
        2,
        ge=0,
        description="Retries (exponential backoff) before the "
        "item fails (reward null, then on_reward_failure).",
    )
    token_env: str | None = Field(
        None,
        description="Environment variable holding a bearer token sent as "
        "Authorization (read by the reward service process).",
    )

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"url {v!r} must start with http:// or https://")
        return v.rstrip("/")

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            groups = re.compile(v).groups
        except re.error as e:
            raise ValueError(f"score_pattern {v!r} is not a valid regular expression: {e}") from e
        if groups < 1:
            raise ValueError(f"score_pattern {v!r} has no group; put the number in (...)")
        return v

    @field_validator("score_range")
    @classmethod
    def _ordered(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not v[0] < v[1]:
            raise ValueError(f"score_range {list(v)} must be [low, high] with low < high")
        return v


RewardSpec = Annotated[
    MathReward
    | LengthReward
    | FormatReward
    | CodeReward
    | PythonReward
    | HttpReward
    | RewardModelReward
    | JudgeReward
    | ReasoningGymReward,
    Field(discriminator="type"),
]
LOCAL_TYPES = frozenset(
    {"math", "length", "format", "code", "python", "reward_model", "judge", "reasoning_gym"}
)


class RewardServerConfig(Strict):
    """`posttrain serve-rewards CONFIG.yaml`: a standalone reward service."""

    rewards: list[RewardSpec] = Field(min_length=1, description="Local components to serve.")
    token_env: str | None = Field(
        None,
        description="Environment variable with the bearer token clients must send; "
        "unset or empty: no auth (bind to 127.0.0.1 then).",
    )
    workers: int = Field(
        2,
        gt=0,
        description="Items scored in parallel: threads, and as many worker processes "
        "for the math, format and python components.",
    )

    @field_validator("rewards")
    @classmethod
    def _local_only(cls, v: list) -> list:
        remote = [c.name for c in v if c.type not in LOCAL_TYPES]
        if remote:
            raise ValueError(
                f"components {remote} are http endpoints; a reward service hosts "
                f"only {sorted(LOCAL_TYPES)}"
            )
        return v
