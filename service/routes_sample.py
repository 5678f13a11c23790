"""Sampling routes of `posttrain serve`: `create_sampling_session`, `samplers/{id}`,
`asample`. A sampler serves a model's adapter as it was saved (`save_weights_for_sampler`)
or the base model; samples come from the rollout engines (`stack.Stack.sample`), with
the sampler's adapter by name. Sampler weights live as long as the service's root: a
sampler held by a client keeps working after later saves and after a restart (its
adapter is put on the engines again from its folder when they no longer hold it)."""

from __future__ import annotations

import secrets
from dataclasses import replace

from fastapi import APIRouter, Request

from .errors import UserError, check
from .registry import SamplerRecord
from .routes_train import body_field, json_body
from .sampling import sampling_request
from .stack import AdapterMissing
from .state import State
from .wire import encode_sample_response

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request, st: State) -> dict:
    body = await json_body(request)
    st.session(body.get("session_id"))
    sid = st.new_id("sampler")
    path = body.get("model_path")
    if path:
        check(path in st.registry.samplers, "model_path", f"{path!r}: no such sampler weights")
        st.registry.samplers[sid] = st.registry.samplers[path]
    else:
        name = st.check_base(body_field(body, "base_model", str))
        st.registry.samplers[sid] = SamplerRecord(name)
    st.registry.save()
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/samplers/{sid}")
async def get_sampler(sid: str, st: State) -> dict:
    s = st.sampler(sid)
    return {"sampler_id": sid, "base_model": s.base_model, "model_path": s.path}


def _unserved(body: dict) -> None:
    """Refuse what the engines cannot serve exactly (a 400 naming it), rather than
    answering without it."""
    for key in ("prompt_logprobs", "topk_prompt_logprobs", "target_prompt_logprobs"):
        value = body.get(key)
        if value not in (None, False, 0):
            raise UserError(key, "prompt logprobs are not served; use forward() to score a prompt")


@router.post("/asample")
async def asample(request: Request, st: State) -> dict:
    body = await json_body(request)
    key = body.get("sampling_session_id") or body.get("model_path")
    s = st.sampler(key)
    _unserved(body)
    prompt, settings, stop_ids = sampling_request(body, st.stack.vocab)
    context = st.stack.context
    check(
        len(prompt) < context,
        "prompt",
        f"{len(prompt)} tokens leave no room in the model's {context}",
    )
    settings = replace(settings, max_new_tokens=min(settings.max_new_tokens, context - len(prompt)))

    def put_back() -> None:
        # an earlier process pushed it, or an engine's slots evicted it: push it again
        # through the learner queue (the learner's verbs run one at a time)
        queue = st.scheduler.queues["learner"]
        queue.put(s.model_id or s.adapter, lambda: st.put_on_engines(s)).result()

    def run() -> bytes:
        if s.adapter is not None and s.adapter not in st.on_engines:
            put_back()
        try:
            seqs = st.stack.sample(s.adapter, prompt, settings, stop_ids)
        except AdapterMissing:
            st.on_engines.discard(s.adapter)
            put_back()
            seqs = st.stack.sample(s.adapter, prompt, settings, stop_ids)
        return encode_sample_response(seqs)

    lane = s.model_id or "base"
    n = settings.n
    return st.submit(
        "sampler",
        lane,
        run,
        None,
        sample_sequence_ids=[f"{key}-{secrets.token_hex(4)}-{i}" for i in range(n)],
    )
