"""The reward protocol (controller → reward service, HTTP `POST /score`).

Request `{"items": [ScoreItem, ...]}`; response `{"scores": [Score, ...]}` with one
score per item, in the request's order, each carrying the item's `uid`. Scoring is
idempotent by `uid`: the same item scored twice gives the same result, so a client
may retry a whole batch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


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
