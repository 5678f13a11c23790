"""`posttrain serve`: a Tinker-compatible HTTP service (the routes, bodies and futures of
the official `tinker` SDK 0.38.0) in front of the same roles a recipe runs: the FSDP2
learner group and the rollout engines (`service/stack.py`), many LoRA sessions on one
base, durable under its root (`service/registry.py`).

Structure: module-level routers (`routes_session`, `routes_train`, `routes_sample`) read
one `ServiceState` through a FastAPI dependency (`state.service_state`); requests that
run on the roles are queued per role and session (`scheduler.py`). Auth: every route but
`/api/v1/healthz` needs the service's token, as the SDK sends it (`X-API-Key`) or as
`Authorization: Bearer`; the SDK only accepts keys that start with `tml-`.

Errors: a request that cannot be run (wrong shapes, unknown model or session, token ids
outside the vocabulary, an unserved loss) gets a 4xx whose body names the field
(`{"detail": ..., "field": ...}`) and `x-should-retry: false`, so that the SDK, which
retries a 409 with backoff for about a minute, reports it at once; the service stays up.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from . import routes_sample, routes_session, routes_train
from .errors import UserError
from .state import ServiceState

OPEN = {"/api/v1/healthz"}
# a refusal that can never succeed as sent: the SDK must not re-send it
NO_RETRY = {"x-should-retry": "false"}


def _user_error(_: Request, e: UserError) -> JSONResponse:
    return JSONResponse(
        {"detail": str(e), "field": e.field}, status_code=e.status, headers=NO_RETRY
    )


def create_app(state: ServiceState) -> FastAPI:
    """The service's FastAPI app over a started `ServiceState`."""
    app = FastAPI(title="posttrain serve")
    app.state.service = state
    app.add_exception_handler(UserError, _user_error)

    @app.middleware("http")
    async def auth(request: Request, call_next):  # noqa: ANN001, ANN202
        if request.url.path in OPEN:
            return await call_next(request)
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        sent = request.headers.get("x-api-key") or bearer
        if not secrets.compare_digest(sent or "", state.token):
            return JSONResponse(
                {
                    "detail": "missing or wrong token (X-API-Key or Authorization: Bearer)",
                    "field": "X-API-Key",
                },
                status_code=401,
                headers=NO_RETRY,
            )
        return await call_next(request)

    for module in (routes_session, routes_train, routes_sample):
        app.include_router(module.router)
    return app
