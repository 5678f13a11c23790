"""`make_engine`: the engine a recipe's `rollout.engine` names. Apart from
`actors/engine.py` so the base module imports none of the classes it builds."""

from __future__ import annotations

from .engine import EngineSettings, InferenceEngine


def make_engine(s: EngineSettings) -> InferenceEngine:
    """The engine for a recipe's `rollout.engine`.

    Raises:
        ValueError: an unknown engine name.
        RuntimeError: 'vllm' or 'vllm_async' asked for but not installed.
    """
    if s.kind == "hf":
        from .hf_engine import HFEngine

        return HFEngine(s.model_path, dtype=s.dtype, device=s.device, max_adapters=s.max_adapters)
    if s.kind in ("vllm", "vllm_async"):
        if s.kind == "vllm":
            from .vllm_engine import VLLMEngine as cls
        else:
            from .vllm_async import AsyncVLLMEngine as cls

        return cls(s)
    raise ValueError(
        f"rollout.engine {s.kind!r} is not available; use 'vllm', 'vllm_async' or 'hf'"
    )
