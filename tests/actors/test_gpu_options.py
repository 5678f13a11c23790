"""vLLM's keyword arguments per device (actors/vllm_engine.gpu_options): nothing GPU-only
reaches a CPU engine; on cuda the memory budget, tensor parallelism and sleep mode."""

from __future__ import annotations

import pytest

from posttrain.actors.vllm_engine import gpu_options


def test_cpu_gets_no_gpu_options():
    assert gpu_options("cpu", 1.0, 0.5, 1, False) == {}
    with pytest.raises(ValueError, match="need device cuda"):
        gpu_options("cpu", 1.0, None, 2, False)


def test_cuda_memory_budget_tensor_parallel_and_sleep():
    assert gpu_options("cuda", 2.0, None, 1, False) == {"kv_cache_memory_bytes": 2 << 30}
    assert gpu_options("cuda", 2.0, 0.3, 2, True) == {
        "gpu_memory_utilization": 0.3,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "ray",
        "enable_sleep_mode": True,
    }


class _FakeLLM:
    def __init__(self):
        self.calls = []

    def wake_up(self, tags):
        self.calls.append(tags)


def test_sleeping_engine_wakes_each_tag_once():
    from posttrain.actors.vllm_engine import VLLMEngine

    eng = object.__new__(VLLMEngine)  # only the sleep bookkeeping, no vLLM
    eng.llm, eng.asleep = _FakeLLM(), {"weights", "kv_cache"}
    eng.wake(["weights"])  # before a weight load
    eng.wake(["weights"])  # a second load: nothing to wake
    eng.wake()  # before generate: the KV cache only
    eng.wake()
    assert eng.llm.calls == [["weights"], ["kv_cache"]] and eng.asleep == set()
