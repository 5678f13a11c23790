"""`posttrain serve`: a Tinker-compatible HTTP service (the routes, bodies and futures of
the official `tinker` SDK 0.38.0), so a loop written against the SDK trains on posttrain
with only its base URL changed.

Structure: the FastAPI app below holds the sessions, training models (`training.py`),
sampling sessions and futures (`futures.py`) in memory; training and sampling run on one
worker thread in arrival order. Auth: every route but `/api/v1/healthz` needs the
service's token, as the SDK sends it (`X-API-Key`) or as `Authorization: Bearer`; the
SDK only accepts keys that start with `tml-`.

Errors: a request that cannot be run (wrong shapes, unknown model or session, token ids
outside the vocabulary, an unserved loss) gets a 4xx whose body names the field
(`{"detail": ..., "field": ...}`); the service stays up.

Limits: state lives in this process (a restart forgets sessions; `save_state` files
survive under `root`); no rate limits; no custom losses.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..common.model_registry import resolve_model_path
from .errors import UserError, check
from .futures import FutureStore
from .sampling import sampling_request
from .training import Adam, ModelSpec, TrainingModel
from .wire import decode_forward_backward, encode_forward_backward_output, encode_sample_response

PROTO = "application/x-protobuf"
LONG_POLL_S = 40.0  # the SDK waits 45 s for a retrieve_future answer


@dataclass
class Sampler:
    """A sampling session: a training model's weights frozen at a version, or the base
    model (`model_id` None)."""

    base_model: str
    model_id: str | None
    weights: dict[str, torch.Tensor] | None
    version: int
    model_path: str | None = None


@dataclass
class State:
    token: str
    root: Path
    base_models: dict[str, Path]
    sessions: dict[str, list[str]] = field(default_factory=dict)
    models: dict[str, TrainingModel] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    futures: FutureStore = field(default_factory=FutureStore)
    ids: Any = field(default_factory=lambda: itertools.count(1))
    base_samplers: dict[str, TrainingModel] = field(default_factory=dict)
    dtype: str = "float32"

    def new_id(self, kind: str) -> str:
        return f"{kind}-{next(self.ids)}-{secrets.token_hex(3)}"

    def model(self, model_id: str | None) -> TrainingModel:
        if model_id not in self.models:
            raise UserError("model_id", f"{model_id!r} is not a live training model", 404)
        return self.models[model_id]

    def base_path(self, name: str) -> Path:
        if name in self.base_models:
            return self.base_models[name]
        try:
            path = resolve_model_path(name)
        except FileNotFoundError as e:
            raise UserError("base_model", f"{name!r} is not served here: {e}", 404) from e
        self.base_models[name] = path
        return path


def _user_error(_: Request, e: UserError) -> JSONResponse:
    return JSONResponse({"detail": str(e), "field": e.field}, status_code=e.status)


def _body_field(body: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise UserError(name, f"missing or not a {getattr(kind, '__name__', kind)}: {value!r}")
    return value


def create_app(
    token: str, root: Path, base_models: dict[str, Path] | None = None, dtype: str = "float32"
) -> FastAPI:
    """The service. `token`: the key clients send; `root`: where checkpoints go;
    `base_models`: names → model folders served (others resolve through posttrain's
    model registry: a built-in alias or a folder path); `dtype`: compute dtype of every
    model (float32, or bfloat16 with float32 master weights)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}: use float32 or bfloat16")
    st = State(token=token, root=root, base_models=dict(base_models or {}), dtype=dtype)
    app = FastAPI(title="posttrain serve")
    app.state.service = st
    app.add_exception_handler(UserError, _user_error)

    @app.middleware("http")
    async def auth(request: Request, call_next):  # noqa: ANN001, ANN202
        if request.url.path == "/api/v1/healthz":
            return await call_next(request)
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        sent = request.headers.get("x-api-key") or bearer
        if not secrets.compare_digest(sent or "", st.token):
            return JSONResponse(
                {
                    "detail": "missing or wrong token (X-API-Key or Authorization: Bearer)",
                    "field": "X-API-Key",
                },
                status_code=401,
            )
        return await call_next(request)

    async def json_body(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as e:
            raise UserError("body", f"not JSON: {e}") from e
        check(isinstance(body, dict), "body", "must be a JSON object")
        return body

    def future(rid: str, model_id: str | None = None, **extra: Any) -> dict:
        return {"request_id": rid, "model_id": model_id, **extra}

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return {
            "supported_models": [
                {"model_name": n, "trainable": True, "sampleable": True} for n in st.base_models
            ]
        }

    @app.post("/api/v1/client/config")
    async def client_config() -> dict:
        return {
            "pjwt_auth_enabled": False,
            "proto_compress_fwdbwd": False,
            "use_pyqwest_transport": False,
            "parallel_fwdbwd_chunks": False,
        }

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session() -> dict:
        sid = st.new_id("session")
        st.sessions[sid] = []
        return {"type": "create_session", "session_id": sid}

    def session(sid: Any) -> list[str]:
        if sid not in st.sessions:
            raise UserError("session_id", f"{sid!r} is not a live session", 404)
        return st.sessions[sid]

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        session((await json_body(request)).get("session_id"))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{sid}/finish")
    async def finish(sid: str) -> Response:
        for mid in st.sessions.pop(sid, []):
            st.models.pop(mid, None)
            for key in [k for k, v in st.samplers.items() if v.model_id == mid]:
                del st.samplers[key]
        return Response(status_code=200)

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        body = await json_body(request)
        models = session(body.get("session_id"))
        name = _body_field(body, "base_model", str)
        path = st.base_path(name)
        lora = body.get("lora_config")
        full = isinstance(body.get("user_metadata"), dict) and (
            body["user_metadata"].get("full_finetune") in (True, "true", "1")
        )
        rank = None if full else _body_field(lora or {}, "rank", int) if lora else None
        check(rank is None or rank > 0, "lora_config.rank", f"must be > 0, got {rank}")
        check(
            full or rank is not None,
            "lora_config",
            "needed (or user_metadata.full_finetune='true' for full fine-tuning)",
        )
        seed = (lora or {}).get("seed") or 0
        spec = ModelSpec(
            name,
            path,
            rank,
            seed,
            (lora or {}).get("train_attn", True),
            (lora or {}).get("train_mlp", True),
            st.dtype,
        )
        check(
            spec.train_attn or spec.train_mlp,
            "lora_config.train_mlp",
            "this service adapts attention and/or MLP; enable one of them",
        )
        mid = st.new_id("model")

        def build() -> dict:
            st.models[mid] = TrainingModel(spec)
            models.append(mid)
            return {"model_id": mid, "type": "create_model"}

        return future(st.futures.submit(build), mid)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        m = st.model((await json_body(request)).get("model_id"))
        mid = next(k for k, v in st.models.items() if v is m)
        return {
            "type": "get_info",
            "model_id": mid,
            "model_data": {"model_name": m.spec.base_model, "tokenizer_id": str(m.spec.path)},
            "is_lora": m.spec.rank is not None,
            "lora_rank": m.spec.rank,
            "model_name": m.spec.base_model,
        }

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        req = decode_forward_backward(await request.body(), request.headers.get("content-encoding"))
        m = st.model(req.model_id)
        config = m.check(req.data, req.loss_fn, req.loss_fn_config)

        def run() -> bytes:
            outputs, metrics = m.forward_backward(req.data, req.loss_fn, config, req.forward_only)
            return encode_forward_backward_output(outputs, metrics)

        return future(st.futures.submit(run), req.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        body = await json_body(request)
        m = st.model(body.get("model_id"))
        params = body.get("adam_params")
        check(isinstance(params, dict), "adam_params", "needed (this service runs Adam)")
        values = {}
        defaults = {
            "learning_rate": 1e-4,
            "beta1": 0.9,
            "beta2": 0.95,
            "eps": 1e-12,
            "weight_decay": 0.0,
            "grad_clip_norm": 0.0,
        }
        for k, d in defaults.items():
            v = params.get(k, d)
            ok = isinstance(v, int | float) and not isinstance(v, bool) and v == v
            check(
                ok and abs(v) != float("inf") and v >= 0,
                f"adam_params.{k}",
                f"must be a finite number ≥ 0, got {v!r}",
            )
            values[k] = float(v)
        adam = Adam(**values)

        def run() -> dict:
            return {"metrics": m.optim_step(adam)}

        return future(st.futures.submit(run), body["model_id"])

    def checkpoint_dir(mid: str, kind: str, name: str) -> Path:
        check(
            name.replace("-", "").replace("_", "").replace(".", "").isalnum(),
            "path",
            f"{name!r}: use letters, digits, '-', '_' or '.'",
        )
        return st.root / mid / kind / name

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        body = await json_body(request)
        mid = body.get("model_id")
        m = st.model(mid)
        name = body.get("path")
        sid = st.new_id("sampler")

        def run() -> dict:
            version = next(st.ids)
            path = f"tinker://{mid}/sampler_weights/{name}" if name else None
            st.samplers[sid] = Sampler(m.spec.base_model, mid, m.snapshot(), version, path)
            if path is not None:
                st.samplers[path] = st.samplers[sid]
            _evict_old_samplers(st, mid)
            return {
                "path": path,
                "sampling_session_id": None if name else sid,
                "type": "save_weights_for_sampler",
            }

        return future(st.futures.submit(run), mid)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        body = await json_body(request)
        mid = body.get("model_id")
        m = st.model(mid)
        name = body.get("path") or f"step-{m.steps}"
        folder = checkpoint_dir(mid, "weights", name)

        def run() -> dict:
            m.save_state(folder)
            return {"path": f"tinker://{mid}/weights/{name}", "type": "save_weights"}

        return future(st.futures.submit(run), mid)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        body = await json_body(request)
        path = _body_field(body, "path", str)
        parts = path.removeprefix("tinker://").split("/")
        check(
            path.startswith("tinker://") and len(parts) == 3 and parts[1] == "weights",
            "path",
            f"{path!r} is not a tinker://<model>/weights/<name> path",
        )
        folder = checkpoint_dir(parts[0], "weights", parts[2])
        check((folder / "state.pt").is_file(), "path", f"{path!r}: no such checkpoint")
        mid = body.get("model_id")
        m = st.model(mid)
        optimizer = bool(body.get("optimizer", False))

        def run() -> dict:
            m.load_state(folder, optimizer)
            return {"path": path, "model_id": mid, "type": "load_weights"}

        return future(st.futures.submit(run), mid)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        body = await json_body(request)
        session(body.get("session_id"))
        sid = st.new_id("sampler")
        path = body.get("model_path")
        if path:
            check(path in st.samplers, "model_path", f"{path!r}: no such sampler weights")
            st.samplers[sid] = st.samplers[path]
        else:
            name = _body_field(body, "base_model", str)
            st.base_path(name)
            st.samplers[sid] = Sampler(name, None, None, 0)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get("/api/v1/samplers/{sid}")
    async def get_sampler(sid: str) -> dict:
        check(sid in st.samplers, "sampler_id", f"{sid!r} is not a sampling session")
        s = st.samplers[sid]
        return {"sampler_id": sid, "base_model": s.base_model, "model_path": s.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        body = await json_body(request)
        sid = body.get("sampling_session_id")
        if sid not in st.samplers:
            raise UserError("sampling_session_id", f"{sid!r} is not a sampling session", 404)
        s = st.samplers[sid]
        model = st.models.get(s.model_id) if s.model_id else None
        if s.model_id and model is None:
            raise UserError("sampling_session_id", "its training model has finished", 404)
        prompt, settings, stop_ids = sampling_request(body, model.vocab if model else None)
        if model is not None:
            check(
                len(prompt) < model.context,
                "prompt",
                f"{len(prompt)} tokens leave no room in the model's {model.context}",
            )
            room = model.context - len(prompt)
            settings = replace(settings, max_new_tokens=min(settings.max_new_tokens, room))

        def run() -> bytes:
            m = model or _base_sampler(st, s.base_model)
            check(
                all(0 <= t < m.vocab for t in prompt),
                "prompt",
                f"token ids must lie in [0, {m.vocab})",
            )
            seqs = m.sample(s.weights, s.version, prompt, settings, stop_ids)
            return encode_sample_response(seqs)

        n = settings.n
        return future(
            st.futures.submit(run),
            None,
            sample_sequence_ids=[f"{sid}-{secrets.token_hex(4)}-{i}" for i in range(n)],
        )

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        rid = (await json_body(request)).get("request_id")
        if not isinstance(rid, str) or not st.futures.known(rid):
            raise UserError("request_id", f"{rid!r} is not a pending request", 404)
        done, payload = await st.futures.retrieve(rid, LONG_POLL_S)
        if not done:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        if isinstance(payload, bytes):
            return Response(payload, media_type=PROTO)
        return JSONResponse(payload)

    return app


KEEP_UNNAMED_SAMPLERS = 8


def _evict_old_samplers(st: State, mid: str) -> None:
    """Keep a model's newest `KEEP_UNNAMED_SAMPLERS` unnamed snapshots (an RL loop makes
    one per step); named ones (`tinker://` paths) stay until the session finishes."""
    unnamed = [k for k, v in st.samplers.items() if v.model_id == mid and v.model_path is None]
    for key in unnamed[:-KEEP_UNNAMED_SAMPLERS]:
        del st.samplers[key]


def _base_sampler(st: State, name: str) -> TrainingModel:
    """A frozen copy of a base model for base-model sampling sessions (built once)."""
    if name not in st.base_samplers:
        spec = ModelSpec(name, st.base_path(name), 1, dtype=st.dtype)
        st.base_samplers[name] = TrainingModel(spec)
    return st.base_samplers[name]
