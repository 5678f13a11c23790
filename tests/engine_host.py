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

    def load_with_reload(self, weights: list) -> None:
        """`load_weights` through vLLM's layerwise reload, the direct load turned off."""
        saved, self.engine.direct = self.engine.direct, None
        try:
            self.engine.load_weights(weights)
        finally:
            self.engine.direct = saved

    def load_stream(self, weights: list) -> None:
        """`load_weights` of a stream (names not known up front, as a streamed push)."""
        self.engine.load_weights(iter(weights))

    def direct_loader(self) -> tuple[bool, str | None]:
        """Whether this engine's pushes take the direct load, and why not."""
        names = set(self.engine.direct or [])

        def ask(worker) -> tuple[bool, str | None]:
            loader = worker.posttrain_direct_loader(names)
            return loader is not None, getattr(worker, "posttrain_direct_why_not", None)

        return self.engine.llm.collective_rpc(ask)[0]

    def kernel_outputs(self, seed: int = 0) -> dict:
        """Every linear and embedding-type layer's kernel applied to a fixed random input
        ([3, in] rows), and the plain parameters (norms, embedding): what a load built."""
        import torch

        def run(worker) -> dict:
            from vllm.model_executor.layers.linear import LinearBase
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            g = torch.Generator().manual_seed(seed)
            out = {}
            model = worker.model_runner.get_model()
            with torch.no_grad():
                for name, m in model.named_modules():
                    if isinstance(m, LinearBase | ParallelLMHead):
                        k = m.input_size if isinstance(m, LinearBase) else m.embedding_dim
                        x = torch.randn(3, k, generator=g).to(m.params_dtype)
                        out[name] = m.quant_method.apply(m, x).clone()
                for name, p in model.named_parameters():
                    if p.numel():
                        out[name] = p.detach().clone()
            return out

        return self.engine.llm.collective_rpc(run)[0]
