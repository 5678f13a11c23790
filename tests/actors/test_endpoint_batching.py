"""The OpenAI endpoint samples the calls of several episodes together: on an engine that
takes one call at a time, the calls that arrive while it samples go in its next engine
call (one batch, not one call each: 8 one-prompt calls of 16 tokens took 4.2 s on the
real model where one engine call of the 8 took 0.85 s); on a concurrent engine they
reach the engine at once (the recorder's lock was held across sampling and ran them one
by one). The engine's time is recorded as the worker's `generate` spans (the idle metric
read 99% idle while the engine sampled every call of a verifiers step).

No timings: the engines here block until the test lets them go, and the test waits on
what it can see (calls queued, callers inside the engine), with generous bounds."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from transformers import AutoTokenizer

from posttrain.actors import worker as worker_module
from posttrain.actors.engine import EngineSettings, Sample
from posttrain.actors.rollout import SamplingSettings
from posttrain.actors.worker import RolloutWorker

WAIT_S = 60.0  # an upper bound for progress on a loaded machine, never a measurement


def _wait_until(what: str, ok) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S:g} s: {what}")
        time.sleep(0.005)


@dataclass
class GatedEngine:
    """An engine whose calls wait for `go`; records the prompts of every call. Sample
    of prompt `p`: token `p[-1] + 1` (so each call's answer names its prompt)."""

    settings: EngineSettings
    concurrent: bool = False
    tokenizer: object = None
    context_tokens: int | None = None
    go: threading.Event = field(default_factory=threading.Event)
    barrier: threading.Barrier | None = None
    calls: list[list[list[int]]] = field(default_factory=list)

    def generate(self, prompts, sampling):
        self.calls.append(prompts)
        if self.barrier is not None:  # concurrent: wait for the other callers to be inside
            self.barrier.wait()
        self.go.wait(WAIT_S)
        return [[Sample([p[-1] + 1], [-0.25], "length")] for p in prompts]

    def close(self):
        pass


def test_calls_queued_while_the_engine_samples_go_in_one_batch():
    """CallBatcher alone: a first call runs alone; three arriving meanwhile (two with
    one setting, one with a longer limit) go next as one engine call per setting, each
    given its own sample."""
    from posttrain.actors.call_batcher import CallBatcher

    engine = GatedEngine(EngineSettings("hf", "unused"))
    batcher = CallBatcher(lambda prompts, s: ([g[0] for g in engine.generate(prompts, s)], 7))
    short, long = SamplingSettings(1, 4, seed=1), SamplingSettings(1, 8, seed=2)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(batcher.generate, [10], short)
        _wait_until("the first call is in the engine", lambda: len(engine.calls) == 1)
        rest = [
            pool.submit(batcher.generate, ids, s)
            for ids, s in (([20], short), ([30], long), ([40], replace_seed(short, 9)))
        ]
        _wait_until("three calls queued", lambda: batcher.waiting() == 3)
        engine.go.set()
        got = [f.result(WAIT_S) for f in [first, *rest]]
    assert [s.token_ids for s, _ in got] == [[11], [21], [31], [41]]
    assert {v for _, v in got} == {7}
    assert sorted(map(sorted, engine.calls)) == [[[10]], [[20], [40]], [[30]]]
    assert list(batcher.batches) == [1, 2, 1]


def replace_seed(s: SamplingSettings, seed: int) -> SamplingSettings:
    return SamplingSettings(s.n, s.max_new_tokens, s.temperature, s.top_p, seed)


def test_an_error_of_a_batch_reaches_only_its_call():
    from posttrain.actors.call_batcher import CallBatcher, _Call

    def run(prompts, s):
        if [13] in prompts:
            raise ValueError("prompt 13 breaks the engine")
        return [Sample([p[0]], [0.0], "stop") for p in prompts], 0

    batcher = CallBatcher(run)
    batch = [_Call([12], SamplingSettings(1, 4)), _Call([13], SamplingSettings(1, 4))]
    batcher._serve(batch)
    assert batch[0].result == (Sample([12], [0.0], "stop"), 0) and batch[0].error is None
    assert isinstance(batch[1].error, ValueError) and batch[1].result is None
    assert list(batcher.batches) == [2, 1, 1]  # the batch, then each call alone
    with pytest.raises(ValueError, match="n = 1"):
        batcher.generate([1], SamplingSettings(2, 4))


def _worker(monkeypatch, tiny_model, engine: GatedEngine) -> RolloutWorker:
    engine.tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    monkeypatch.setattr(worker_module, "make_engine", lambda s: engine)
    return RolloutWorker(0, EngineSettings(kind="vllm", model_path="unused"), "object_store", 1)


def _call(url: str, episode: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": f"hi {episode}"}], "max_tokens": 4}
    with httpx.Client(base_url=url, timeout=WAIT_S) as http:
        return http.post("/chat/completions", json=body, headers={"X-Episode-Id": episode})


def test_endpoint_batches_episodes_on_a_one_call_engine(monkeypatch, tiny_model):
    """Four episodes' calls on the endpoint of a one-call-at-a-time engine: the first
    runs alone, the three arriving meanwhile go in one engine call; each episode records
    its own prompt and sample, and each engine call is a `generate` span of the step."""
    engine = GatedEngine(EngineSettings("vllm", "unused"))
    w = _worker(monkeypatch, tiny_model, engine)
    url = w.serve_openai(max_tokens=4, temperature=1.0, step=5)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(_call, url, "ep-0")
        _wait_until("the first call is in the engine", lambda: len(engine.calls) == 1)
        rest = [pool.submit(_call, url, f"ep-{i}") for i in (1, 2, 3)]
        _wait_until("three calls queued", lambda: w.batcher.waiting() == 3)
        engine.go.set()
        assert [f.result(WAIT_S).status_code for f in [first, *rest]] == [200] * 4
    assert [len(c) for c in engine.calls] == [1, 3]
    for i in range(4):
        (c,) = w.pop_episode(f"ep-{i}")["calls"]
        assert c["completion_ids"] == [c["prompt_ids"][-1] + 1]  # its own sample
    spans = [s for s in w.drain_spans() if s.role == "rollout" and s.kind == "generate"]
    assert [s.step for s in spans] == [5, 5]
    w.close()


def test_endpoint_calls_of_two_episodes_reach_a_concurrent_engine_at_once(monkeypatch, tiny_model):
    """On a concurrent engine the endpoint takes no lock across sampling: two episodes'
    calls are inside the engine together (the recorder's lock ran them one by one)."""
    engine = GatedEngine(EngineSettings("vllm", "unused"), concurrent=True)
    engine.barrier = threading.Barrier(2, timeout=20)
    engine.go.set()
    w = _worker(monkeypatch, tiny_model, engine)
    url = w.serve_openai(max_tokens=4, temperature=1.0)
    with ThreadPoolExecutor(2) as pool:
        codes = [r.status_code for r in pool.map(_call, [url, url], ["ep-a", "ep-b"])]
    assert codes == [200, 200]
    assert [len(c) for c in engine.calls] == [1, 1]
    w.close()


def test_more_calls_wait_together_than_the_servers_default_forty_threads(monkeypatch, tiny_model):
    """The endpoint's route runs on the server's worker threads, 40 by default
    (anyio's limiter): 64 episodes' calls then went to the engine as 39 + 24 (a
    step's 64 calls were three engine calls, not two). 43 calls now wait together."""
    engine = GatedEngine(EngineSettings("vllm", "unused"))
    w = _worker(monkeypatch, tiny_model, engine)
    url = w.serve_openai(max_tokens=4, temperature=1.0)
    with ThreadPoolExecutor(44) as pool:
        first = pool.submit(_call, url, "ep-0")
        _wait_until("the first call is in the engine", lambda: len(engine.calls) == 1)
        rest = [pool.submit(_call, url, f"ep-{i}") for i in range(1, 44)]
        _wait_until("43 calls queued", lambda: w.batcher.waiting() == 43)
        engine.go.set()
        assert {f.result(WAIT_S).status_code for f in [first, *rest]} == {200}
    assert [len(c) for c in engine.calls] == [1, 43]
    w.close()
