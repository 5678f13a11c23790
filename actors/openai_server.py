"""An OpenAI-compatible `/v1/chat/completions` endpoint in front of a rollout engine, for
black-box agent programs (any framework that speaks the OpenAI chat API), with every
call of an episode recorded token-exactly.

Protocol (agent → rollout worker):
- `POST /v1/chat/completions`: the OpenAI chat request (`messages`, `max_tokens` or
  `max_completion_tokens`, `temperature`, `top_p`, `seed` (default: one of its own per
  episode and call, `call_seed`), `stop`; `n` must be 1; other fields are accepted and
  ignored) plus the episode id, as the `X-Episode-Id` header or an `episode_id` body
  field (`extra_body` in the OpenAI SDK). Answer: a
  `chat.completion` object; its `choices[0].logprobs` is null (the ids and logprobs are
  kept here, not sent).
- `POST /v1/episodes/{episode_id}/reward` `{"reward": float}`: the agent's reward for
  the episode (optional: a reward service may score it instead).
- `GET /health`.

Token bookkeeping: when a call's messages extend the episode's previous call (its
messages plus the assistant's reply, compared as role + content), its prompt ids are the
previous call's prompt + sampled ids followed by the chat template's delta for the new
messages (actors/chat.py), so the model's earlier tokens are never re-tokenised. A call
that does not extend the previous one (the agent rewrote or dropped history) is
tokenised afresh and counted in `restarts`; the episode's trajectory then starts again
from it (recipes/episodes/agent.py).

Concurrency: requests are served on the server's threads and take the worker's engine
lock, so they never overlap `generate` or a weight load on the same engine.

Limits: no streaming, no `tools` / `tool_choice` rendering (tool calls travel as text,
e.g. Hermes `<tool_call>` blocks), no authentication: bind it to a private address.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from .chat import TemplateMismatch, chat_ids, message_delta
from .engine import Sample, end_of_turn_token_id
from .rollout import SamplingSettings


def call_seed(episode_id: str, index: int) -> int:
    """The sampling seed of call `index` of episode `episode_id` when the request gives
    none: the first 7 bytes of sha256("episode_id:index"), so the episodes of one
    prompt (ids `{group_id}-{k}`, the group id naming the step) sample differently, and
    the same episode samples the same after a resume. The worker then makes it its
    engine's own (`engine_seed`)."""
    digest = hashlib.sha256(f"{episode_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


@dataclass
class Call:
    """One recorded completion (rollout worker → controller).

    Attributes:
        prompt_ids: `[P]` the ids the engine was given.
        completion_ids: `[C]` the sampled ids.
        logprobs: `[C]` their `inference_logprobs` (under the request's temperature).
        policy_version: version of the weights that sampled them.
        finish_reason: 'stop' or 'length'.
        temperature: the request's temperature.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: str
    temperature: float


@dataclass
class EpisodeLog:
    """Every call of one episode, the agent's reward, and the conversation state."""

    calls: list[Call] = field(default_factory=list)
    reward: float | None = None
    restarts: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


class EpisodeRecorder:
    """Thread-safe store of `EpisodeLog`s by episode id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.episodes: dict[str, EpisodeLog] = {}

    def get(self, episode_id: str) -> EpisodeLog:
        with self.lock:
            return self.episodes.setdefault(episode_id, EpisodeLog())

    def pop(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's calls, reward and restarts as plain data, removed; None if unknown."""
        with self.lock:
            log = self.episodes.pop(episode_id, None)
        if log is None:
            return None
        return {
            "calls": [asdict(c) for c in log.calls],
            "reward": log.reward,
            "restarts": log.restarts,
        }


class ChatRequest(BaseModel):
    """The OpenAI chat request fields used here (others are ignored)."""

    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    episode_id: str | None = None


class RewardRequest(BaseModel):
    reward: float


def _text_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": str(m.get("role", "user")), "content": str(content)})
    return out


def create_app(
    generate: Callable[[list[int], SamplingSettings], tuple[Sample, int]],
    tokenizer: Any,
    recorder: EpisodeRecorder,
    default_max_tokens: int = 256,
    temperature: float | None = None,
) -> Any:
    """The FastAPI app (see the module docstring).

    Args:
        generate: (prompt ids, sampling with n = 1) → (the sample, policy_version); the
            caller holds the engine lock inside it.
        tokenizer: the policy's tokenizer with its chat template.
        recorder: where calls are recorded.
        default_max_tokens: completion limit when the request gives none, and the most
            a request may ask for when `temperature` is set (training).
        temperature: when set (training), every call samples at it whatever the request
            says: the learner recomputes logprobs at the recipe's temperature.
    """
    from fastapi import FastAPI, Header, HTTPException

    app = FastAPI(title="posttrain rollout (OpenAI-compatible)")
    eot = end_of_turn_token_id(tokenizer)

    def prompt_ids(log: EpisodeLog, messages: list[dict[str, str]]) -> list[int]:
        n = len(log.messages)
        if log.calls and len(messages) > n and messages[:n] == log.messages:
            try:
                return log.ids + message_delta(
                    tokenizer, log.messages, messages[n:], log.ids[-1], eot
                )
            except TemplateMismatch:
                pass
        if log.calls:
            log.restarts += 1
        return chat_ids(tokenizer, messages, generation_prompt=True)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/v1/chat/completions")
    def complete(req: ChatRequest, x_episode_id: str | None = Header(None)) -> dict[str, Any]:
        episode = x_episode_id or req.episode_id
        if not episode:
            raise HTTPException(
                400,
                "give the episode id as the X-Episode-Id header or an "
                "episode_id field, so the call joins its episode's trajectory",
            )
        if req.n != 1:
            raise HTTPException(400, f"n={req.n}: one completion per call (n: 1)")
        messages = _text_messages(req.messages)
        log = recorder.get(episode)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        limit = req.max_completion_tokens or req.max_tokens or default_max_tokens
        if temperature is not None:
            limit = min(limit, default_max_tokens)
        sampling = SamplingSettings(
            n=1,
            max_new_tokens=limit,
            temperature=temperature if temperature is not None else req.temperature,
            top_p=req.top_p,
            seed=req.seed if req.seed is not None else call_seed(episode, len(log.calls)),
            stop=stop,
        )
        with recorder.lock:  # one call of an episode at a time keeps its chain ordered
            ids = prompt_ids(log, messages)
            sample, version = generate(ids, sampling)
            text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            log.calls.append(
                Call(
                    ids,
                    list(sample.token_ids),
                    list(sample.logprobs),
                    version,
                    sample.finish_reason,
                    sampling.temperature,
                )
            )
            log.messages = [*messages, {"role": "assistant", "content": text}]
            log.ids = ids + list(sample.token_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model_extra.get("model", "policy") if req.model_extra else "policy",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": sample.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(sample.token_ids),
                "total_tokens": len(ids) + len(sample.token_ids),
            },
        }

    @app.post("/v1/episodes/{episode_id}/reward")
    def reward(episode_id: str, body: RewardRequest) -> dict[str, Any]:
        recorder.get(episode_id).reward = body.reward
        return {"episode_id": episode_id, "reward": body.reward}

    return app
