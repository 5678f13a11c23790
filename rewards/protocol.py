"""The reward protocol (controller → reward service, HTTP `POST /score`).

Request `{"items": [ScoreItem, ...]}`; response `{"scores": [Score, ...]}` with one
score per item, in the request's order, each carrying the item's `uid`. Scoring is
idempotent by `uid`: the same item scored twice gives the same result, so a client
may retry a whole batch.

Numbers: a reward must be finite in float32, the dtype it trains in. `NaN`, `Infinity`,
an overflowing literal such as `1e400` (JSON parsers read these as floats) or a value
past float32's range such as `1e39` is never a reward: `checked` turns it into a
failed score naming its source, which the recipe's `on_reward_failure` then handles. A
non-finite number among `details` is kept as its text (`"nan"`), so one stray value
neither fails the item nor makes the response unserialisable.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from ..common.numbers import FLOAT32_MAX, finite32


class ScoreItem(BaseModel):
    """One rollout to score."""

    uid: str = Field(description="Unique id of the rollout; echoed in its Score.")
    prompt: str = Field("", description="Prompt text (verifiers must not read answers from it).")
    response: str = Field(description="The policy's response text.")
    ground_truth: str | None = Field(None, description="Reference answer, if any.")
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="The prompt row's other keys; `data_source` picks the components with "
        "`sources` that apply to the item.",
    )
    messages: list[dict[str, str]] | None = Field(
        None,
        description="The prompt as chat messages ([{role, content}]: an optional system "
        "message, then user and assistant turns, ending with a user or tool turn) as the "
        "policy saw them; reward models and judges render these with a chat template. "
        "null: `prompt` is taken as one user message.",
    )


class ScoreRequest(BaseModel):
    items: list[ScoreItem] = Field(description="Batch of rollouts; uids must be unique.")


class Score(BaseModel):
    """The result for one item: `reward` or `error`, never both missing."""

    uid: str
    reward: float | None = Field(description="Weighted reward; null when scoring failed.")
    error: str | None = Field(None, description="Why scoring failed; null on success.")
    details: dict[str, Any] = Field(
        default_factory=dict, description="Per-component rewards and verifier details."
    )


class ScoreResponse(BaseModel):
    scores: list[Score]


def is_finite_number(x: Any) -> bool:
    """Whether `x` is an int or float (not a bool) that is finite in float32, the dtype
    rewards train in (`common.numbers.finite32`: 1e39 is not)."""
    return finite32(x)


def finite_details(details: dict[str, Any]) -> dict[str, Any]:
    """`details` with each non-finite float replaced by its text ('nan', 'inf')."""
    return {
        k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
        for k, v in details.items()
    }


def checked(score: Score, source: str) -> Score:
    """`score` as is when its reward is finite (or already failed); a failed score
    naming `source` and the value when the reward is NaN or infinite. Non-finite
    details become text either way (see the module docstring)."""
    details = finite_details(score.details)
    if score.reward is None or finite32(score.reward):
        return score.model_copy(update={"details": details}) if details != score.details else score
    return Score(
        uid=score.uid,
        reward=None,
        error=f"{source} gave a non-finite reward ({score.reward!r}) for {score.uid}; "
        f"a reward must be a finite number (|r| ≤ {FLOAT32_MAX:.7g}, float32's range)",
        details=details,
    )
