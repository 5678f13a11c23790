"""The OpenAI-compatible endpoint on the vLLM engine, in a rollout worker started as the
run starts it (a Ray actor pinned to `threads` torch threads): the endpoint's calls run
on the server's pool threads, not on the thread that built the engine, and vLLM's CPU
attention checks the calling thread's OpenMP thread count against the engine's."""

from __future__ import annotations

import httpx
import pytest
import ray

from posttrain.actors.engine import EngineSettings
from posttrain.actors.worker import RolloutWorker
from tests.engine_host import requires_vllm
from tests.tiny_model import build_tiny_model

pytestmark = [pytest.mark.vllm, requires_vllm]


def test_chat_completion_on_a_two_thread_vllm_engine(ray_local, tmp_path):
    """Ray starts the actor with OMP_NUM_THREADS=1, so the server's threads have one
    OpenMP thread against the engine's two: vLLM's CPU attention refused every call
    ("thread_num (1 vs. 2)", a 500) until the engine set the calling thread's count."""
    folder = build_tiny_model(tmp_path / "m", hidden=128, max_positions=1024)
    worker = ray.remote(num_cpus=0)(RolloutWorker).remote(
        0,
        EngineSettings(kind="vllm", model_path=str(folder), dtype="float32"),
        "object_store",
        2,
    )
    try:
        url = ray.get(worker.serve_openai.remote(max_tokens=4))
        body = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 4, "seed": 1}
        with httpx.Client(base_url=url, timeout=120) as http:
            for episode in ("e-0", "e-1"):  # two calls: two of the pool's threads, or one twice
                r = http.post("/chat/completions", json=body, headers={"X-Episode-Id": episode})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        ray.kill(worker)
