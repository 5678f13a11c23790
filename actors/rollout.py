"""Wire types of the rollout side.

`PromptRequest`: controller → rollout worker. `Rollout`: rollout worker → controller
(→ reward services as text, → learner as a padded `TrainBatch`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class PromptRequest:
    """One prompt to sample a group for.

    Attributes:
        group_id: id shared by every sample of this prompt in this step.
        messages: chat messages (`[{"role", "content"}]`); the engine applies the
            model's chat template with a generation prompt.
        ground_truth: reference answer, copied into each Rollout for the verifier.
        metadata: copied into each Rollout.
        prefixes: a resume's saved samples of this prompt (`n` dicts of
            `actors.partial.PartialSample.to_dict`: token ids, logprobs, per-token
            versions, done), continued instead of sampled afresh (partial rollouts on a
            worker with a push gate, actors/worker_inflight.py); None: sample afresh.
    """

    group_id: str
    messages: list[dict[str, str]]
    ground_truth: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    prefixes: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: `n` samples per prompt, at most `max_new_tokens` tokens each."""

    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings; the response keeps the one that ended it
    # more token ids that end a sample, beside the model's own end tokens (the service's
    # `stop` given as ids); the response keeps the one that ended it, as it keeps an EOS
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Rollout:
    """One sampled response.

    Attributes:
        uid: unique id of this sample in the run (`{group_id}-{index}`).
        group_id: the prompt's group in this step.
        prompt_ids: `[P]` prompt token ids after the chat template.
        response_ids: `[R]` sampled token ids, ending with EOS (or the tokens of a stop
            string) when `finish_reason` is 'stop'; R ≤ max_new_tokens.
        inference_logprobs: `[R]` the engine's logprob of each sampled token under the
            sampling temperature (log softmax(logits / T)), before top-p.
        finish_reason: 'stop' (EOS or a stop string sampled) or 'length' (hit
            max_new_tokens).
        policy_version: optimizer steps behind the weights that sampled it (with partial
            rollouts, the version of its first token: the oldest, which staleness counts).
        prompt_text, response_text: decoded text (response without special tokens).
        ground_truth, metadata: copied from the PromptRequest.
        loss_mask: `[R]` for a multi-turn episode (recipes/episodes/multiturn.py): 1 on the
            model's sampled tokens, 0 on environment tokens (tool results, user
            messages) inside the response, which the loss never counts; None (every
            response token is the model's) for a single-turn sample.
        turns: a multi-turn episode's segments (role, ids, mask, logprobs,
            policy_version, text), for the rollout files; None for single-turn.
        policy_versions: `[R]` with partial rollouts (`rollout.partial`), the
            policy_version that sampled each response token (a weight push mid-sample
            changes it; `inference_logprobs[t]` is under `policy_versions[t]`); None: every
            token by `policy_version`.
        messages: the PromptRequest's chat messages (reward models render them); not
            written by `to_dict` (the rollout files hold `prompt_text`).
    """

    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    inference_logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    prompt_text: str
    response_text: str
    ground_truth: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    loss_mask: list[int] | None = None
    turns: list[dict[str, Any]] | None = None
    policy_versions: list[int] | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Every field but `messages`; a single-turn sample's rollout-file line is as
        before (no `loss_mask` / `turns` / `policy_versions` keys when they are None)."""
        out = asdict(self)
        del out["messages"]
        for key in ("loss_mask", "turns", "policy_versions"):
            if out[key] is None:
                del out[key]
        return out
