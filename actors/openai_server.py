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
  the episode (optional: a reward service may score it instead), after its calls.
- `GET /health`.

Refusals (OpenAI's error shape, `{"error": {"message", "type":
"invalid_request_error", "param"}}`, nothing sampled or recorded): 400 for a field out of
its bounds (`ChatRequest`: empty `messages`, `max_tokens` < 1, `top_p` outside (0, 1],
a `seed` outside 64 bits, an empty stop string, ...), for `temperature: 0` when the
request's temperature is used, and for a prompt that leaves no room in the engine's
context (`param: messages`, the limit in the message; a prompt that fits gets at most
what is left of the context as its completion limit); 400 for a reward that is not a
finite number (`NaN`, `Infinity`, `1e400`: recorded on the episode, whose sample then
fails; a later finite reward replaces it); 404 for a reward of an episode that was
never served here.

Memory: the recorder keeps at most `max_episodes` episodes (default 4096); a call with
a new id beyond that evicts the least recently used episode (its calls are lost, and the
controller reports that episode as having made no call).

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
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

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
    """Every call of one episode, the agent's reward (or why its posted reward was
    refused), and the conversation state."""

    calls: list[Call] = field(default_factory=list)
    reward: float | None = None
    reward_error: str | None = None
    restarts: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


class EpisodeRecorder:
    """Thread-safe store of `EpisodeLog`s by episode id, at most `max_episodes` of them
    (least recently used evicted first).

    Raises (at construction):
        ValueError: max_episodes < 1.
    """

    def __init__(self, max_episodes: int = 4096) -> None:
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be at least 1, got {max_episodes}")
        self.max_episodes = max_episodes
        self.lock = threading.Lock()
        self.episodes: OrderedDict[str, EpisodeLog] = OrderedDict()

    def get(self, episode_id: str) -> EpisodeLog:
        """The episode's log, made when new (evicting the least recently used one when
        the store is full)."""
        with self.lock:
            return self.keep(episode_id, self.episodes.get(episode_id) or EpisodeLog())

    def keep(self, episode_id: str, log: EpisodeLog) -> EpisodeLog:
        """Store `log` under `episode_id` as the most recently used, evicting the least
        recently used beyond `max_episodes`; the caller holds `lock`."""
        self.episodes[episode_id] = log
        self.episodes.move_to_end(episode_id)
        while len(self.episodes) > self.max_episodes:
            self.episodes.popitem(last=False)
        return log

    def find(self, episode_id: str) -> EpisodeLog | None:
        """The episode's log if it has one here, else None (nothing is made)."""
        with self.lock:
            return self.episodes.get(episode_id)

    def pop(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's calls, reward, reward_error and restarts as plain data,
        removed; None if unknown."""
        with self.lock:
            log = self.episodes.pop(episode_id, None)
        if log is None:
            return None
        return {
            "calls": [asdict(c) for c in log.calls],
            "reward": log.reward,
            "reward_error": log.reward_error,
            "restarts": log.restarts,
        }


class Message(BaseModel):
    """One chat message; content as text or OpenAI content parts (their text is kept)."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str | list[Any] | None = None


StopString = Annotated[str, Field(min_length=1)]


class ChatRequest(BaseModel):
    """The OpenAI chat request fields used here, with their bounds (others are
    accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: StopString | list[StopString] | None = Field(None, max_length=16)
    n: int = Field(1, ge=1)
    episode_id: str | None = Field(None, min_length=1, max_length=512)


class RewardRequest(BaseModel):
    reward: float  # finiteness is checked by the route, which records a refusal


def _text_messages(messages: list[Message]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        content = m.content or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append({"role": m.role, "content": content})
    return out


def _error(status: int, message: str, param: str | None) -> Any:
    """An OpenAI-shaped error response (`detail` too, as FastAPI clients expect)."""
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"message": message, "type": kind, "param": param, "code": None}
    return JSONResponse({"error": body, "detail": message}, status_code=status)


class Refused(Exception):
    """A request this endpoint will not serve: its status, message and field."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _validation_error(exc: Any) -> Any:
    """400 naming the first invalid field, its problem and (shortened) value."""
    first = exc.errors()[0]
    param = ".".join(str(x) for x in first["loc"] if x != "body") or "body"
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return _error(400, f"{param}: {first['msg']} (got {got})", param)


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (at least 1): no token
    covers more text, so a prompt of more than context × this many characters (× 4 for
    normalisation) cannot fit without tokenising it."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def create_app(
    generate: Callable[[list[int], SamplingSettings], tuple[Sample, int]],
    tokenizer: Any,
    recorder: EpisodeRecorder,
    default_max_tokens: int = 256,
    temperature: float | None = None,
    context_tokens: int | None = None,
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
        context_tokens: the most tokens (prompt + completion) the engine takes; a
            longer prompt is refused, a completion capped to what is left. None: no
            check here.
    """
    from fastapi import FastAPI, Header, HTTPException
    from fastapi.exceptions import RequestValidationError

    app = FastAPI(title="posttrain rollout (OpenAI-compatible)")
    eot = end_of_turn_token_id(tokenizer)
    max_chars = (
        None if context_tokens is None else 4 * context_tokens * _longest_token_chars(tokenizer)
    )

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Any, exc: RequestValidationError) -> Any:
        return _validation_error(exc)

    @app.exception_handler(Refused)
    async def refused(_: Any, exc: Refused) -> Any:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(_: Any, exc: HTTPException) -> Any:
        return _error(exc.status_code, str(exc.detail), None)

    def prompt_ids(log: EpisodeLog, messages: list[dict[str, str]]) -> tuple[list[int], bool]:
        """The call's prompt ids, and whether it restarts the episode's chain."""
        n = len(log.messages)
        if log.calls and len(messages) > n and messages[:n] == log.messages:
            try:
                delta = message_delta(tokenizer, log.messages, messages[n:], log.ids[-1], eot)
                return log.ids + delta, False
            except TemplateMismatch:
                pass
        return chat_ids(tokenizer, messages, generation_prompt=True), bool(log.calls)

    def fit(ids: list[int], limit: int) -> int:
        """The completion limit left once `ids` are in the context.

        Raises:
            Refused: the prompt leaves no room for one token.
        """
        if context_tokens is None:
            return limit
        if len(ids) >= context_tokens:
            raise Refused(
                400,
                f"messages: the conversation is {len(ids)} tokens after the chat "
                f"template; the engine takes {context_tokens} tokens (prompt + "
                "completion); shorten the messages",
                "messages",
            )
        return min(limit, context_tokens - len(ids))

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
            raise Refused(400, f"n: {req.n} completions asked; one per call (n: 1)", "n")
        if temperature is None and req.temperature == 0:
            raise Refused(
                400,
                "temperature: 0 (greedy) is not served here; give a temperature above 0",
                "temperature",
            )
        messages = _text_messages(req.messages)
        chars = sum(len(m["content"]) for m in messages)
        if max_chars is not None and chars > max_chars:
            raise Refused(
                400,
                f"messages: {chars} characters cannot fit in the engine's "
                f"{context_tokens} tokens; shorten the messages",
                "messages",
            )
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        limit = req.max_completion_tokens or req.max_tokens or default_max_tokens
        if temperature is not None:
            limit = min(limit, default_max_tokens)
        with recorder.lock:  # one call of an episode at a time keeps its chain ordered
            log = recorder.episodes.get(episode) or EpisodeLog()  # kept once it is served
            ids, restarted = prompt_ids(log, messages)
            sampling = SamplingSettings(
                n=1,
                max_new_tokens=fit(ids, limit),
                temperature=temperature if temperature is not None else req.temperature,
                top_p=req.top_p,
                seed=req.seed if req.seed is not None else call_seed(episode, len(log.calls)),
                stop=stop,
            )
            sample, version = generate(ids, sampling)
            log.restarts += restarted
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
            recorder.keep(episode, log)
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
        log = recorder.find(episode_id)
        if log is None or not log.calls:
            raise Refused(
                404,
                f"episode_id {episode_id!r}: no call was served under this id (or its "
                "episode was already collected); post a reward after the episode's calls, "
                "with the id they used",
                "episode_id",
            )
        if not math.isfinite(body.reward):
            log.reward, log.reward_error = (
                None,
                (f"agent reward for episode {episode_id} is {body.reward!r}, not a finite number"),
            )
            raise Refused(400, f"reward: {body.reward!r} is not a finite number", "reward")
        log.reward, log.reward_error = body.reward, None
        return {"episode_id": episode_id, "reward": body.reward}

    return app
