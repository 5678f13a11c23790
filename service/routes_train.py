"""Training routes of `posttrain serve`: `create_model`, `get_info`, `forward_backward`,
`optim_step`, `save_weights_for_sampler`, `save_weights`, `load_weights` (which also
creates a model from a saved state, as `create_training_client_from_state` asks).
Each checks its body, then queues the roles' verbs (`stack.Stack`) on the learner queue
in the model's lane."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from .checks import adam_params, check_data
from .errors import UserError, check
from .registry import ModelRecord, SamplerRecord
from .scheduler import Batchable
from .state import ServiceState, State
from .wire import decode_forward_backward, encode_forward_backward_output

router = APIRouter(prefix="/api/v1")


async def json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise UserError("body", f"not JSON: {e}") from e
    check(isinstance(body, dict), "body", "must be a JSON object")
    return body


def body_field(body: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise UserError(name, f"missing or not a {getattr(kind, '__name__', kind)}: {value!r}")
    return value


def _model_id(st: ServiceState, body: dict) -> str:
    """The SDK's own id for a new model, `<session>:train:<model_seq_id>`, when it sends
    one (it derives the id itself for `create_training_client_from_state`)."""
    seq = body.get("model_seq_id")
    if isinstance(seq, int) and not isinstance(seq, bool):
        return f"{body.get('session_id')}:train:{seq}"
    return st.new_id("model")


def _new_model(st: ServiceState, body: dict, rank: int, seed: int, attn: bool, mlp: bool):
    models = st.session(body.get("session_id"))
    check(
        len(st.registry.models) < st.cfg.sessions.max_sessions,
        "session_id",
        f"this service holds {st.cfg.sessions.max_sessions} training models already "
        "(sessions.max_sessions); finish a session first",
    )
    mid = _model_id(st, body)
    check(mid not in st.registry.models, "model_seq_id", f"model {mid!r} exists already")
    rec = ModelRecord(mid, body["session_id"], st.base_name, rank, seed, attn, mlp)
    return models, rec


@router.post("/create_model")
async def create_model(request: Request, st: State) -> dict:
    body = await json_body(request)
    st.check_base(body.get("base_model"))
    meta = body.get("user_metadata")
    if isinstance(meta, dict) and meta.get("full_finetune") in (True, "true", "1"):
        raise UserError(
            "user_metadata.full_finetune",
            "full fine-tuning is not served on the shared base (every session is a LoRA "
            "adapter on it); use create_lora_training_client, or `posttrain run` a recipe",
            409,
        )
    lora = body.get("lora_config")
    check(isinstance(lora, dict), "lora_config", "needed: every session is a LoRA adapter")
    rank = body_field(lora, "rank", int)
    top = st.cfg.sessions.max_rank
    check(0 < rank <= top, "lora_config.rank", f"must be 1..{top} (sessions.max_rank), got {rank}")
    attn, mlp = lora.get("train_attn", True), lora.get("train_mlp", True)
    check(attn or mlp, "lora_config.train_mlp", "enable train_attn and/or train_mlp")
    seed = lora.get("seed") or 0
    check(isinstance(seed, int), "lora_config.seed", f"must be an integer, got {seed!r}")
    models, rec = _new_model(st, body, rank, seed, bool(attn), bool(mlp))

    def run() -> dict:
        st.stack.open(rec.model_id, rank, seed, rec.train_attn, rec.train_mlp)
        st.registry.models[rec.model_id] = rec
        models.append(rec.model_id)
        st.registry.save()
        return {"model_id": rec.model_id, "type": "create_model"}

    return st.submit("learner", rec.model_id, run, rec.model_id)


@router.post("/get_info")
async def get_info(request: Request, st: State) -> dict:
    rec = st.model((await json_body(request)).get("model_id"))
    return {
        "type": "get_info",
        "model_id": rec.model_id,
        "model_data": {"model_name": rec.base_model, "tokenizer_id": st.stack.model_path},
        "is_lora": True,
        "lora_rank": rec.rank,
        "model_name": rec.base_model,
    }


@router.post("/forward_backward")
async def forward_backward(request: Request, st: State) -> dict:
    req = decode_forward_backward(await request.body(), request.headers.get("content-encoding"))
    rec = st.model(req.model_id)
    config = check_data(req.data, req.loss_fn, req.loss_fn_config, st.stack.vocab, st.stack.context)

    backward = not req.forward_only

    def run() -> bytes:
        outputs, metrics = st.stack.forward_backward(
            rec.model_id, req.data, req.loss_fn, config, backward
        )
        return encode_forward_backward_output(outputs, metrics)

    def run_many(items: list[tuple]) -> list[bytes]:
        done = st.stack.forward_backward_many(items, backward)
        return [encode_forward_backward_output(o, m) for o, m in done]

    batch = Batchable(
        ("forward_backward", backward),
        (rec.model_id, req.data, req.loss_fn, config),
        run_many,
        st.cfg.sessions.batch,
    )
    return st.submit("learner", rec.model_id, run, rec.model_id, batch)


@router.post("/optim_step")
async def optim_step(request: Request, st: State) -> dict:
    body = await json_body(request)
    rec = st.model(body.get("model_id"))
    adam = adam_params(body.get("adam_params"))

    def run() -> dict:
        out = st.stack.optim_step(rec.model_id, adam)
        rec.steps += 1
        return {"metrics": {"grad_norm:mean": float(out.get("grad_norm", 0.0))}}

    return st.submit("learner", rec.model_id, run, rec.model_id)


def checkpoint_name(name: Any) -> str:
    check(
        isinstance(name, str) and name.replace("-", "").replace("_", "").replace(".", "").isalnum(),
        "path",
        f"{name!r}: use letters, digits, '-', '_' or '.'",
    )
    return name


@router.post("/save_weights_for_sampler")
async def save_for_sampler(request: Request, st: State) -> dict:
    body = await json_body(request)
    rec = st.model(body.get("model_id"))
    name = body.get("path")
    if name is not None:
        checkpoint_name(name)
    sid = st.new_id("sampler")

    def run() -> dict:
        version = st.registry.next_version()
        folder = st.root / rec.model_id / "sampler_weights" / (name or sid)
        st.stack.save(rec.model_id, folder, optimizer=False)
        path = f"tinker://{rec.model_id}/sampler_weights/{name}" if name else None
        s = SamplerRecord(rec.base_model, rec.model_id, rec.rank, sid, version, path, str(folder))
        st.stack.publish(rec.model_id, sid, version)
        st.on_engines.add(sid)
        st.registry.samplers[sid] = s
        if path is not None:
            st.registry.samplers[path] = s
        st.registry.save()
        return {
            "path": path,
            "sampling_session_id": None if name else sid,
            "type": "save_weights_for_sampler",
        }

    return st.submit("learner", rec.model_id, run, rec.model_id)


@router.post("/save_weights")
async def save_weights(request: Request, st: State) -> dict:
    body = await json_body(request)
    rec = st.model(body.get("model_id"))
    name = checkpoint_name(body.get("path") or f"step-{rec.steps}")

    def run() -> dict:
        st.save_model(rec, name)
        return {"path": f"tinker://{rec.model_id}/weights/{name}", "type": "save_weights"}

    return st.submit("learner", rec.model_id, run, rec.model_id)


def _saved_state(st: ServiceState, path: Any) -> tuple[ModelRecord | None, Path, str]:
    """(the saving model's record if it is known, the folder, its model id) of a
    `tinker://<model>/weights/<name>` path."""
    check(isinstance(path, str), "path", "needed: tinker://<model>/weights/<name>")
    parts = path.removeprefix("tinker://").split("/")
    check(
        path.startswith("tinker://") and len(parts) == 3 and parts[1] == "weights",
        "path",
        f"{path!r} is not a tinker://<model>/weights/<name> path",
    )
    folder = st.root / parts[0] / "weights" / checkpoint_name(parts[2])
    check(folder.is_dir(), "path", f"{path!r}: no such checkpoint")
    return st.registry.models.get(parts[0]), folder, parts[0]


@router.post("/load_weights")
async def load_weights(request: Request, st: State) -> dict:
    """Load a saved state into a live model (`load_state[_with_optimizer]`), or, with
    `session_id` + `model_seq_id` and no `model_id`, into a new model of the saving
    model's rank (`create_training_client_from_state[_with_optimizer]`). Without
    `optimizer` the AdamW state starts afresh, as after `create_model`."""
    body = await json_body(request)
    source, folder, source_id = _saved_state(st, body.get("path"))
    optimizer = bool(body.get("optimizer", False))
    if body.get("model_id") is None:
        check(source is not None, "path", f"the model that saved it ({source_id}) is unknown")
        models, rec = _new_model(
            st, body, source.rank, source.seed, source.train_attn, source.train_mlp
        )
        created = True
    else:
        rec, models, created = st.model(body.get("model_id")), None, False

    def run() -> dict:
        if created:
            st.stack.open(rec.model_id, rec.rank, rec.seed, rec.train_attn, rec.train_mlp)
            st.registry.models[rec.model_id] = rec
            models.append(rec.model_id)
        st.stack.load(rec.model_id, folder, optimizer)
        st.registry.save()
        return {"path": body["path"], "model_id": rec.model_id, "type": "load_weights"}

    return st.submit("learner", rec.model_id, run, rec.model_id)
