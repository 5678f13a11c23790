"""vLLM's AsyncLLM engine (`rollout.vllm.async_engine`, actors/vllm_async.py): calls from
several threads are batched together instead of queueing, and a weight push during a
long generation keeps every request, resumes it under the new weights and tags each
token with the policy_version that sampled it (the partial-rollout contract of
actors/partial.py), with each token's logprob under its own version."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.checkpoint_files import checkpoint_params
from posttrain.actors.engine import EngineSettings
from posttrain.actors.partial import version_spans
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.actors.vllm_async import CORE_TAKES_ALL_PARAMS, core_threads, span_versions
from posttrain.actors.worker import RolloutWorker
from posttrain.weightsync import TransportSettings
from posttrain.weightsync.filesystem import FilesystemTransport
from tests.engine_host import requires_vllm


def _span(version: str, start: int, end: int) -> SimpleNamespace:
    return SimpleNamespace(version=version, start=start, end=end)


def test_the_engine_core_leaves_one_core_to_the_caller_of_a_small_model():
    small = CORE_TAKES_ALL_PARAMS - 1
    assert [core_threads(n, small) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]


def test_the_engine_core_takes_every_core_for_a_large_model():
    large = CORE_TAKES_ALL_PARAMS
    assert [core_threads(n, large) for n in (1, 2, 4, 16)] == [1, 2, 4, 16]


def test_checkpoint_params_counts_the_folder_s_tensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "extra.safetensors"))
    assert checkpoint_params(str(tmp_path)) == 12 + 5 + 8


def test_span_versions_hand_computed():
    assert span_versions([_span("3", 0, 2), _span("4", 2, 3)], 3, 9) == [3, 3, 4]
    assert span_versions(None, 2, 5) == [5, 5]
    assert span_versions([], 0, 5) == []
    with pytest.raises(RuntimeError, match="cover 2 of 3"):
        span_versions([_span("1", 0, 2)], 3, 0)
    with pytest.raises(RuntimeError, match="skip tokens"):
        span_versions([_span("1", 1, 3)], 3, 0)


class ProbeWorker(RolloutWorker):
    """Test-only: holds the engine at a known token, to push mid-generation."""

    def hold_after(self, tokens: int) -> int:
        """Once some request holds `tokens` output tokens, pause the engine (requests
        and KV kept; the push's own pause then frees the KV, loads and resumes); the
        most tokens a request held then."""
        engine = self.engine

        async def hold() -> int:
            states = engine.llm.output_processor.request_states
            while True:
                counts = [s.detokenizer.num_output_tokens() for s in states.values()]
                if counts and max(counts) >= tokens:
                    await engine.llm.pause_generation(mode="keep", clear_cache=False)
                    return max(counts)
                await asyncio.sleep(0.0005)

        return engine._run(hold())

    def concurrent_calls(self, prompt: list[int]) -> tuple[bool, int]:
        """A short call made while a long one runs: whether the long one was still in
        flight when the short one returned (a locked engine would have finished it
        first), and how many samples the long one returned."""
        long_out: list = []
        long = threading.Thread(
            target=lambda: long_out.extend(
                self.engine.generate([prompt], SamplingSettings(n=8, max_new_tokens=400))
            )
        )
        long.start()
        while not self.engine.inflight:
            time.sleep(0.001)
        self.engine.generate([prompt], SamplingSettings(n=1, max_new_tokens=2, seed=1))
        overlapped = long.is_alive()
        long.join()
        return overlapped, len(long_out[0])


def _worker(model, tmp_path) -> ray.actor.ActorHandle:
    return (
        ray.remote(num_cpus=0, max_concurrency=4)(ProbeWorker)
        .options()
        .remote(
            0,
            EngineSettings(kind="vllm_async", model_path=str(model), dtype="float32", seed=7),
            TransportSettings(type="filesystem", directory=str(tmp_path / "weights")),
            threads=1,
            partial=True,
        )
    )


def _logprobs_under(model, prompt: list[int], response: list[int]) -> list[float]:
    """Each response token's log softmax at T = 1 under `model` (fp32)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


@pytest.mark.vllm
@requires_vllm
def test_a_push_mid_generation_keeps_requests_and_tags_versions(
    ray_local, tiny_model_vllm, tmp_path
):
    torch.manual_seed(0)
    w = _worker(tiny_model_vllm, tmp_path)
    old = AutoModelForCausalLM.from_pretrained(tiny_model_vllm, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_vllm, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    handle = FilesystemTransport(str(tmp_path / "weights")).send(dict(new.state_dict()), 1)
    prompts = [
        PromptRequest("s0-p0", [{"role": "user", "content": "12+30?"}]),
        PromptRequest("s0-p1", [{"role": "user", "content": "7*6?"}]),
    ]
    sampling = SamplingSettings(n=8, max_new_tokens=400, temperature=1.0, seed=11)
    ray.get(w.policy_version.remote())  # started
    pending = w.generate.remote(prompts, sampling, 0)
    assert ray.get(w.hold_after.remote(5)) >= 5
    assert ray.get(w.update_weights.remote(handle, 0)) == 1
    rollouts = ray.get(pending)

    assert [r.uid for r in rollouts] == [f"s0-p{i}-{k}" for i in range(2) for k in range(8)]
    spanned = 0
    for r in rollouts:
        assert len(r.policy_versions) == len(r.response_ids) == len(r.inference_logprobs)
        assert r.policy_versions == sorted(r.policy_versions)
        assert r.policy_version == r.policy_versions[0]
        assert len(r.response_ids) == 400 or r.finish_reason == "stop"
        cut = r.policy_versions.count(0)
        if 0 < cut < len(r.response_ids):
            spanned += 1
            assert version_spans(r.policy_versions) == [
                (0, cut, 0),
                (cut, len(r.response_ids), 1),
            ]
        # each token's logprob is its own version's (fp32 on both sides: 1e-4)
        want_old = _logprobs_under(old, r.prompt_ids, r.response_ids)[:cut]
        want_new = _logprobs_under(new, r.prompt_ids, r.response_ids)[cut:]
        assert r.inference_logprobs == pytest.approx(want_old + want_new, abs=1e-4)
    assert spanned >= 1  # at least one sample ran on across the push
    assert max(r.policy_versions.count(0) for r in rollouts) >= 5  # held at the fifth token

    # calls from two threads run at once: the short one returns while the long one runs
    prompt = rollouts[0].prompt_ids
    assert ray.get(w.concurrent_calls.remote(prompt)) == (True, 8)

    # the OpenAI endpoint on it: 4 agent calls at once, each recorded under version 1
    url = ray.get(w.serve_openai.remote(max_tokens=8, temperature=1.0))

    def call(episode: str) -> int:
        body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8}
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/chat/completions", json=body, headers={"X-Episode-Id": episode})
            return r.status_code

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(call, [f"ep-{i}" for i in range(4)])) == [200] * 4
    for i in range(4):
        (c,) = ray.get(w.pop_episode.remote(f"ep-{i}"))["calls"]
        assert c["policy_version"] == 1 and 1 <= len(c["completion_ids"]) <= 8
    ray.get(w.close.remote())
    ray.kill(w)
