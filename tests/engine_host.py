"""Engines under test live in a Ray actor: vLLM in-process sets up torch.distributed
and patches torch threads, which must not leak into the pytest process."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from posttrain.actors.engine import EngineSettings
from posttrain.actors.factory import make_engine
from posttrain.common.process import set_torch_threads

requires_vllm = pytest.mark.skipif(
    not __import__("posttrain.config", fromlist=["vllm_installed"]).vllm_installed(),
    reason="vLLM is not installed here",
)


class EngineHost:
    """Builds one engine in its own process and forwards calls to it."""

    def __init__(self, settings: EngineSettings):
        set_torch_threads(1)
        self.engine = make_engine(settings)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def attr(self, name: str) -> Any:
        return getattr(self.engine, name)


class RemoteEngine:
    """`engine.method(...)` on an engine inside an `EngineHost` actor."""

    def __init__(self, settings: EngineSettings):
        self.actor = ray.remote(num_cpus=0)(EngineHost).remote(settings)

    def __getattr__(self, method: str):
        return lambda *args: ray.get(self.actor.call.remote(method, *args))

    def attr(self, name: str) -> Any:
        return ray.get(self.actor.attr.remote(name))

    def kill(self) -> None:
        ray.kill(self.actor)


class VLLMProbe(EngineHost):
    """Test-only: loads weights while skipping the prefix-cache reset, to show a test
    would catch a missing reset."""

    def load_without_reset(self, weights: list) -> None:
        self.engine.llm.collective_rpc("posttrain_load_weights", args=(iter(weights),))

    def embedding_repacks(self, weights: list) -> list[str]:
        """Load `weights` and return the class of each embedding-type module whose
        weight vLLM's CPU backend repacked into a matmul handler during that load."""
        import vllm.model_executor.layers.utils as layer_utils
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        def count(worker) -> list[str]:
            seen, real = [], layer_utils.dispatch_cpu_unquantized_gemm

            def spy(layer, remove_weight):
                if isinstance(layer, VocabParallelEmbedding):
                    seen.append(type(layer).__name__)
                return real(layer, remove_weight)

            layer_utils.dispatch_cpu_unquantized_gemm = spy
            try:
                worker.posttrain_load_weights(iter(weights))
            finally:
                layer_utils.dispatch_cpu_unquantized_gemm = real
            return seen

        return self.engine.llm.collective_rpc(count)[0]
