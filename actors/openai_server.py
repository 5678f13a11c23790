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
- `POST /v1/episodes/{episode_id}/reward` `{"reward": float, "components": {name: float}}`
  or `{"error": str}` (the episode's sample then fails naming it), after its calls: the
  agent's reward (optional: a reward service may score it instead).
- `stream: true` answers the same completion as server-sent `chat.completion.chunk`
  events (sampled whole first; `stream_options.include_usage` adds the usage chunk).
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

Concurrency: requests are served on the server's threads (`CALL_THREADS` at once,
anyio's default being 40). The calls of one episode run
one at a time (`EpisodeRecorder.turn`); calls of different episodes reach `generate`
at once, where the worker batches them (actors/call_batcher.py) or a concurrent engine
does, under the worker's engine lock, so they never overlap a weight load.

Limits: no token-by-token streaming, no `tools` / `tool_choice` rendering (tool calls travel
as text, e.g. Hermes `<tool_call>` blocks), no authentication: bind it to a private address.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread

from ..common.numbers import finite32
from .chat import TemplateMismatch, chat_ids, message_delta
from .engine import Sample, end_of_turn_token_id
from .episode_recorder import Call, EpisodeLog, EpisodeRecorder
from .openai_protocol import (
    ChatRequest,
    Refused,
    RewardRequest,
    completion_body,
    error_response,
    stream_events,
    text_messages,
    validation_error_response,
)
from .rollout import SamplingSettings

__all__ = ["ChatEndpoint", "EpisodeRecorder", "call_seed", "create_app"]

#: Calls served at once, each holding a server thread while it waits for its sample
#: (anyio's default is 40); calls beyond wait for a thread, and go in a later batch.
CALL_THREADS = 1024


def call_seed(episode_id: str, index: int) -> int:
    """The sampling seed of call `index` of episode `episode_id` when the request gives
    none: the first 7 bytes of sha256("episode_id:index"), so the episodes of one
    prompt (ids `{group_id}-{k}`, the group id naming the step) sample differently, and
    the same episode samples the same after a resume. The worker then makes it its
    engine's own (`engine_seed`)."""
    digest = hashlib.sha256(f"{episode_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (at least 1): no token
    covers more text, so a prompt of more than context × this many characters (× 4 for
    normalisation) cannot fit without tokenising it."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class ChatEndpoint:
    """What the routes of `create_app` do (see the module docstring and `create_app`'s
    arguments); every refusal raises `Refused`."""

    def __init__(
        self,
        generate: Callable[[list[int], SamplingSettings], tuple[Sample, int]],
        tokenizer: Any,
        recorder: EpisodeRecorder,
        default_max_tokens: int,
        temperature: float | None,
        context_tokens: int | None,
    ):
        self.generate, self.tokenizer, self.recorder = generate, tokenizer, recorder
        self.default_max_tokens, self.temperature = default_max_tokens, temperature
        self.context_tokens = context_tokens
        self.eot = end_of_turn_token_id(tokenizer)
        # No token covers more characters than the longest vocabulary entry (× 4 for
        # normalisation): a longer text cannot fit, and is refused without tokenising it.
        self.max_chars = (
            None if context_tokens is None else 4 * context_tokens * _longest_token_chars(tokenizer)
        )

    def prompt_ids(self, log: EpisodeLog, messages: list[dict[str, str]]) -> tuple[list[int], bool]:
        """The call's prompt ids, and whether it restarts the episode's chain."""
        n, tok = len(log.messages), self.tokenizer
        if log.calls and len(messages) > n and messages[:n] == log.messages:
            try:
                delta = message_delta(tok, log.messages, messages[n:], log.ids[-1], self.eot)
                return log.ids + delta, False
            except TemplateMismatch:
                pass
        return chat_ids(tok, messages, generation_prompt=True), bool(log.calls)

    def fit(self, ids: list[int], limit: int) -> int:
        """The completion limit left once `ids` are in the context.

        Raises:
            Refused: the prompt leaves no room for one token.
        """
        if self.context_tokens is None:
            return limit
        if len(ids) >= self.context_tokens:
            raise Refused(
                400,
                f"messages: the conversation is {len(ids)} tokens after the chat "
                f"template; the engine takes {self.context_tokens} tokens (prompt + "
                "completion); shorten the messages",
                "messages",
            )
        return min(limit, self.context_tokens - len(ids))

    def checked_messages(self, req: ChatRequest) -> list[dict[str, str]]:
        """The request's messages as text, after the refusals that need no tokens.

        Raises:
            Refused: n ≠ 1, temperature 0 where it is used, a text too long to fit.
        """
        if req.n != 1:
            raise Refused(400, f"n: {req.n} completions asked; one per call (n: 1)", "n")
        if self.temperature is None and req.temperature == 0:
            raise Refused(
                400,
                "temperature: 0 (greedy) is not served here; give a temperature above 0",
                "temperature",
            )
        messages = text_messages(req.messages)
        chars = sum(len(m["content"]) for m in messages)
        if self.max_chars is not None and chars > self.max_chars:
            raise Refused(
                400,
                f"messages: {chars} characters cannot fit in the engine's "
                f"{self.context_tokens} tokens; shorten the messages",
                "messages",
            )
        return messages

    def complete(self, req: ChatRequest, episode: str) -> tuple[list[int], Sample, str]:
        """Sample one completion for `episode` and record it: (prompt ids, the sample,
        its text).

        Raises:
            Refused: see `checked_messages` and `fit`; nothing is recorded then.
        """
        messages = self.checked_messages(req)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        limit = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
        if self.temperature is not None:
            limit = min(limit, self.default_max_tokens)
        rec = self.recorder
        with rec.turn(episode):  # its calls one at a time: each extends the one before
            log = rec.find(episode) or EpisodeLog()  # kept once it is served
            ids, restarted = self.prompt_ids(log, messages)
            sampling = SamplingSettings(
                n=1,
                max_new_tokens=self.fit(ids, limit),
                temperature=self.temperature if self.temperature is not None else req.temperature,
                top_p=req.top_p,
                seed=req.seed if req.seed is not None else call_seed(episode, len(log.calls)),
                stop=stop,
            )
            # no store-wide lock here: other episodes' calls sample meanwhile (batched)
            sample, version = self.generate(ids, sampling)
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            tokens, logprobs = list(sample.token_ids), list(sample.logprobs)
            with rec.lock:
                log.calls.append(
                    Call(ids, tokens, logprobs, version, sample.finish_reason, sampling.temperature)
                )
                log.restarts += restarted
                log.messages = [*messages, {"role": "assistant", "content": text}]
                log.ids = ids + tokens
                rec.keep(episode, log)
        return ids, sample, text

    def reward(self, episode_id: str, body: RewardRequest) -> None:
        """Record the agent's reward (and its components, or why it could not score)
        for a served episode.

        Raises:
            Refused: 404 for an episode never served here; 400 for a reward (or a
                component) missing or not finite, recorded: its sample then fails.
        """
        log = self.recorder.find(episode_id)
        if log is None or not log.calls:
            raise Refused(
                404,
                f"episode_id {episode_id!r}: no call was served under this id (or its "
                "episode was already collected); post a reward after the episode's calls, "
                "with the id they used",
                "episode_id",
            )
        if body.error is not None:
            log.reward, log.components = None, {}
            log.reward_error = f"episode {episode_id}: the agent could not score it: {body.error}"
            return
        parts = {f"components.{k}": v for k, v in body.components.items()}
        values = {"reward": body.reward} | parts
        for name, value in values.items():
            if value is None or not finite32(value):
                log.reward, log.components = None, {}
                log.reward_error = (
                    f"agent {name} for episode {episode_id} is {value!r}, not a finite number"
                )
                raise Refused(400, f"{name}: {value!r} is not a finite number", name)
        log.reward, log.components, log.reward_error = body.reward, dict(body.components), None


def _openai_errors(app: Any) -> None:
    """Every error of `app` as an OpenAI error body: bad fields (422 as 400), our
    refusals, and FastAPI's own HTTP errors."""
    from fastapi import HTTPException
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Any, exc: RequestValidationError) -> Any:
        return validation_error_response(exc)

    @app.exception_handler(Refused)
    async def refused(_: Any, exc: Refused) -> Any:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(_: Any, exc: HTTPException) -> Any:
        return error_response(exc.status_code, str(exc.detail), None)


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
        generate: (prompt ids, sampling with n = 1) → (the sample, policy_version);
            called from FastAPI's thread pool, several episodes at once: it batches
            them (the worker's `CallBatcher`, holding the engine lock per batch) or a
            concurrent engine does (AsyncLLM).
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
    from fastapi import FastAPI, Header
    from fastapi.responses import StreamingResponse

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        # the sync routes run on this server's worker threads, 40 by default: more
        # calls at once must reach the batcher together, not 39 at a time
        anyio.to_thread.current_default_thread_limiter().total_tokens = CALL_THREADS
        yield

    app = FastAPI(title="posttrain rollout (OpenAI-compatible)", lifespan=lifespan)
    endpoint = ChatEndpoint(
        generate, tokenizer, recorder, default_max_tokens, temperature, context_tokens
    )

    _openai_errors(app)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/v1/chat/completions")
    def complete(req: ChatRequest, x_episode_id: str | None = Header(None)) -> Any:
        episode = x_episode_id or req.episode_id
        if not episode:
            raise Refused(
                400,
                "episode_id: give the episode id as the X-Episode-Id header or an "
                "episode_id field, so the call joins its episode's trajectory",
                "episode_id",
            )
        ids, sample, text = endpoint.complete(req, episode)
        extra = req.model_extra or {}
        model, n = extra.get("model", "policy"), len(sample.token_ids)
        body = completion_body(model, text, sample.finish_reason, len(ids), n)
        if extra.get("stream") is True:
            usage = bool((extra.get("stream_options") or {}).get("include_usage"))
            events = iter(stream_events(body, usage))
            return StreamingResponse(events, media_type="text/event-stream")
        return body

    @app.post("/v1/episodes/{episode_id}/reward")
    def reward(episode_id: str, body: RewardRequest) -> dict[str, Any]:
        endpoint.reward(episode_id, body)
        return {"episode_id": episode_id, "reward": body.reward}

    return app
