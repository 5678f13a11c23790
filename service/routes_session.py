"""Session and service routes of `posttrain serve`: health, capabilities, the SDK's
client configuration, sessions (`create_session`, heartbeats, `finish`), futures
(`retrieve_future`) and `status` (the roles, sessions, queue depths and idle
fractions)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .errors import UserError
from .routes_train import json_body
from .state import State

PROTO = "application/x-protobuf"
LONG_POLL_S = 40.0  # the SDK waits 45 s for a retrieve_future answer

router = APIRouter(prefix="/api/v1")


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(st: State) -> dict:
    return {
        "supported_models": [{"model_name": st.base_name, "trainable": True, "sampleable": True}]
    }


@router.post("/client/config")
async def client_config() -> dict:
    return {
        "pjwt_auth_enabled": False,
        "proto_compress_fwdbwd": False,
        "use_pyqwest_transport": False,
        "parallel_fwdbwd_chunks": False,
    }


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict:
    return {}


@router.post("/telemetry")
async def telemetry() -> dict:
    return {"status": "accepted"}


@router.post("/create_session")
async def create_session(st: State) -> dict:
    sid = st.new_id("session")
    st.registry.sessions[sid] = []
    st.last_seen[sid] = time.time()
    st.registry.save()
    return {"type": "create_session", "session_id": sid}


@router.post("/session_heartbeat")
async def heartbeat(request: Request, st: State) -> dict:
    st.session((await json_body(request)).get("session_id"))
    return {"type": "session_heartbeat"}


@router.post("/sessions/{sid}/finish")
async def finish(sid: str, st: State) -> Response:
    """End a session: its queued requests are cancelled and its models closed on the
    learner (their saved states and sampler weights stay under root)."""
    mids = st.registry.sessions.pop(sid, [])
    for mid in mids:
        st.scheduler.drop(mid)
        rec = st.registry.models.pop(mid, None)
        if rec is not None:
            st.scheduler.submit("learner", mid, lambda m=mid: st.stack.close(m))
    st.registry.save()
    return Response(status_code=200)


@router.get("/status")
async def status(st: State) -> dict:
    """What runs: the roles (ranks, engines, verbs run on each, idle fractions, the
    adapters delivered to the engines), queue depths, and each model's last step."""
    return {
        "roles": st.stack.status(),
        "queues": st.scheduler.depths(),
        "sessions": {sid: list(mids) for sid, mids in st.registry.sessions.items()},
        "models": {
            mid: {"steps": r.steps, "rank": r.rank, "saved": r.saved is not None}
            for mid, r in st.registry.models.items()
        },
    }


@router.post("/retrieve_future")
async def retrieve_future(request: Request, st: State) -> Response:
    rid = (await json_body(request)).get("request_id")
    if isinstance(rid, str) and st.scheduler.from_earlier_process(rid):
        # 410 Gone: the SDK raises `RetryableException` ("promise expired"), which its
        # sampling client re-sends by itself; never another request's result
        return JSONResponse(
            {
                "detail": f"request {rid} was in flight when the service restarted; it did "
                "not complete: send it again",
                "field": "request_id",
            },
            status_code=410,
        )
    if not isinstance(rid, str) or not st.scheduler.known(rid):
        raise UserError("request_id", f"{rid!r} is not a pending request", 404)
    done, payload = await st.scheduler.retrieve(rid, LONG_POLL_S)
    if not done:
        return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
    if isinstance(payload, bytes):
        return Response(payload, media_type=PROTO)
    return JSONResponse(payload)
