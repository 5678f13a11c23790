"""The SDK's binary wire format (client → service → client), read and written with the
protobuf schema of the pinned `tinker` SDK (`tinker.proto.tinker_public_pb2`), so the
service speaks exactly what that SDK version sends and expects.

Only `forward_backward` (request) and its output and `sample`'s output travel as
protobuf; every other route is JSON (see `service.app`). A request that cannot be read
raises `UserError` naming the field, which the app turns into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import UserError


def _pb():  # noqa: ANN202 (a module-level lazy import)
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:
        raise RuntimeError(
            "posttrain serve reads the SDK's wire schema from the `tinker` package: "
            "pip install tinker==0.38.0 (or `pip install -e '.[dev]'`)"
        ) from e
    return tinker_public_pb2


@dataclass
class WireDatum:
    """One training example as the SDK sends it.

    Attributes:
        tokens: `[N]` int64 model input ids (the text chunks, concatenated).
        inputs: loss inputs by name, each a dense `[N]` array (`target_tokens` int64;
            `weights`, `logprobs`, `advantages` float32).
    """

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class WireForwardBackward:
    """A decoded `/api/v1/forward_backward` body."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[WireDatum]


def _tensor(msg, where: str) -> np.ndarray:  # noqa: ANN001 (a protobuf message)
    pb = _pb()
    dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}.get(msg.dtype)
    if dtype is None:
        raise UserError(where, f"dtype {msg.dtype} is not float32 or int64")
    if msg.HasField("sparse_csr"):
        raise UserError(where, "sparse tensors are not supported by this service; send dense")
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    shape = list(msg.shape) or [arr.size]
    if int(np.prod(shape)) != arr.size:
        raise UserError(where, f"shape {shape} does not match its {arr.size} values")
    arr = arr.reshape(shape)
    if dtype is np.float32 and not np.isfinite(arr).all():
        raise UserError(where, "has non-finite values (NaN or inf)")
    return arr


def decode_forward_backward(body: bytes, content_encoding: str | None) -> WireForwardBackward:
    """Decode the SDK's protobuf `ForwardBackwardRequest` (zstd when `content_encoding`
    is "zstd"). Raises `UserError` on a body that is not one."""
    pb = _pb()
    if content_encoding == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except zstandard.ZstdError as e:
            raise UserError("body", f"zstd body cannot be decompressed: {e}") from e
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf raises its own DecodeError, not a stable class
        raise UserError("body", f"not a ForwardBackwardRequest protobuf: {e}") from e
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = float(v.number)
        else:
            raise UserError(f"loss_fn_config.{k}", "only numbers are supported")
    data = []
    for i, d in enumerate(msg.data):
        parts = []
        for j, chunk in enumerate(d.model_input):
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise UserError(f"data[{i}].model_input.chunks[{j}]", "only token chunks")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        inputs = {
            name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}")
            for name, t in d.loss_fn_inputs.items()
        }
        data.append(WireDatum(tokens=tokens, inputs=inputs))
    return WireForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        data=data,
    )


def _batched(arrays: list[np.ndarray], dtype: type) -> object:
    pb = _pb()
    flat = [np.ascontiguousarray(a, dtype=dtype).ravel() for a in arrays]
    item = np.dtype(dtype).itemsize
    offsets = np.concatenate([[0], np.cumsum([a.size * item for a in flat])]).astype(np.int64)
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in flat),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_FLOAT32 if dtype is np.float32 else pb.DTYPE_INT64,
    )


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """The SDK's protobuf `ForwardBackwardOutput`: one `ArrayRecord` whose fields hold,
    per datum, the `[N]` float32 arrays of `outputs` (e.g. `logprobs`)."""
    pb = _pb()
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else []:
        record.fields[name].CopyFrom(_batched([o[name] for o in outputs], np.float32))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]]) -> bytes:
    """The SDK's protobuf `SampleResponse`: per sequence its sampled token ids, their
    per-token logprobs (same length) and its stop reason ("stop" or "length")."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        msg.sequences.append(
            pb.SampledSequence(
                stop_reason=reasons[reason],
                tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
            )
        )
    return msg.SerializeToString()
