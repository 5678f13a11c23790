"""An `/api/v1/asample` body (the SDK's `SampleRequest`) read into posttrain's sampling
settings, every field checked: a bad one is a `UserError` naming it (a 400)."""

from __future__ import annotations

import secrets

from ..actors.rollout import SamplingSettings
from .errors import UserError, check


def sampling_request(
    body: dict, vocab: int | None
) -> tuple[list[int], SamplingSettings, list[int] | None]:
    """(prompt ids, settings, stop token ids or None for the model's) of an asample body.
    Raises UserError naming the field."""
    chunks = (body.get("prompt") or {}).get("chunks")
    check(isinstance(chunks, list) and chunks, "prompt.chunks", "needs at least one chunk")
    prompt: list[int] = []
    for i, c in enumerate(chunks):
        toks = c.get("tokens") if isinstance(c, dict) else None
        check(
            isinstance(toks, list) and all(isinstance(t, int) for t in toks),
            f"prompt.chunks[{i}].tokens",
            "must be a list of token ids",
        )
        prompt.extend(toks)
    check(bool(prompt), "prompt", "has no tokens")
    if vocab is not None:
        bad = [t for t in prompt if not 0 <= t < vocab]
        check(not bad, "prompt", f"token id {bad[:1]} is outside the vocabulary [0, {vocab})")
    p = body.get("sampling_params") or {}
    n = body.get("num_samples", 1)
    check(isinstance(n, int) and 1 <= n <= 256, "num_samples", f"must be 1..256, got {n!r}")
    max_tokens = p.get("max_tokens") or 128
    check(
        isinstance(max_tokens, int) and max_tokens > 0,
        "sampling_params.max_tokens",
        f"must be a positive integer, got {max_tokens!r}",
    )
    temperature = p.get("temperature", 1.0)
    check(
        isinstance(temperature, int | float) and 0 < temperature < 100,
        "sampling_params.temperature",
        f"must be in (0, 100), got {temperature!r}",
    )
    top_p = p.get("top_p", 1.0)
    check(
        isinstance(top_p, int | float) and 0 < top_p <= 1,
        "sampling_params.top_p",
        f"must be in (0, 1], got {top_p!r}",
    )
    check(p.get("top_k", -1) in (-1, 0), "sampling_params.top_k", "top-k is not supported")
    stop = p.get("stop")
    strings: tuple[str, ...] = ()
    stop_ids = None
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        strings = tuple(stop)
    elif isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
        stop_ids = list(stop)
    elif stop == []:  # the SDK's documented "no stop sequences": the model's EOS only
        pass
    elif stop is not None:
        raise UserError("sampling_params.stop", "must be strings or token ids")
    check(all(strings), "sampling_params.stop", "stop strings must not be empty")
    seed = p.get("seed")
    settings = SamplingSettings(
        n=n,
        max_new_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        seed=seed if isinstance(seed, int) else secrets.randbelow(2**31),
        stop=strings,
    )
    return prompt, settings, stop_ids
