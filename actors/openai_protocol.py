"""Wire types of the OpenAI-compatible agent endpoint (agent → rollout worker,
actors/openai_server.py): the request bodies with their bounds, and the OpenAI-shaped
error answers (`{"error": {"message", "type", "param", "code"}}`, plus FastAPI's
`detail`) every refusal gets."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field


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
    """An episode's score from the agent: `reward`, optionally its parts by name
    (`components`, each a reward component in the metrics), or `error` (the agent could
    not score the episode: its sample fails with that message). Finiteness is checked
    by the route, which records a refusal."""

    reward: float | None = None
    components: dict[str, float] = Field(default_factory=dict, max_length=64)
    error: str | None = Field(None, min_length=1, max_length=4000)


def text_messages(messages: list[Message]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        content = m.content or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append({"role": m.role, "content": content})
    return out


def completion_body(
    model: str, text: str, finish_reason: str, prompt_len: int, completion_len: int
) -> dict[str, Any]:
    """A `chat.completion` object for one sampled text (`logprobs` null: the ids and
    logprobs stay on the worker)."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion_len,
            "total_tokens": prompt_len + completion_len,
        },
    }


def stream_events(body: dict[str, Any], include_usage: bool) -> list[str]:
    """`body` (a `chat.completion`) as the server-sent events of a streamed one
    (`stream: true`): a role chunk, one content chunk, the finish chunk, the usage
    chunk when `stream_options.include_usage`, then `data: [DONE]`. The text is
    sampled whole first, so streaming changes only the wire, not what is recorded."""
    choice = body["choices"][0]
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> str:
        c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return "data: " + json.dumps(head | {"choices": [c]} | extra) + "\n\n"

    events = [
        chunk({"role": "assistant", "content": ""}, None),
        chunk({"content": choice["message"]["content"]}, None),
        chunk({}, choice["finish_reason"]),
    ]
    if include_usage:
        usage = head | {"choices": [], "usage": body["usage"]}
        events.append("data: " + json.dumps(usage) + "\n\n")
    return [*events, "data: [DONE]\n\n"]


def error_response(status: int, message: str, param: str | None) -> Any:
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


def validation_error_response(exc: Any) -> Any:
    """400 naming the first invalid field, its problem and (shortened) value."""
    first = exc.errors()[0]
    param = ".".join(str(x) for x in first["loc"] if x != "body") or "body"
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return error_response(400, f"{param}: {first['msg']} (got {got})", param)
