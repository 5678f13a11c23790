"""Every rollout engine samples with a seed of its own: engine `rank` derives it from the
step's seed (the recipe's `train.seed`, the step and the round) and its rank, so two
engines given the same prompt in the same step return different samples, and the same
engine in the same step (a resume) returns the same ones. Checked on the HF engine for
real and, for both engine kinds, on the seeds the worker hands its engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest

from posttrain.actors import worker as worker_module
from posttrain.actors.engine import EngineSettings, Sample, engine_seed
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.actors.worker import RolloutWorker

PROMPT = PromptRequest("s3-p0-0", [{"role": "user", "content": "2+2?"}])
SAMPLING = SamplingSettings(n=4, max_new_tokens=8, temperature=1.0, seed=300_009)


def test_engine_seed_hand_computed():
    assert engine_seed(300_009, 0) == 300_009  # one engine samples as before
    # 0x9E3779B97F4A7C15 mod 2^32 = 2135587861
    assert engine_seed(300_009, 1) == 2_135_587_861 + 300_009
    seeds = {engine_seed(s, r) for s in range(200) for r in range(8)}
    assert len(seeds) == 200 * 8  # no two (seed, rank) pairs collide
    # vLLM seeds numpy with it: 0 <= seed < 2^32 (rank 1 at 2^61 killed its engine)
    assert all(0 <= s < 2**32 for s in seeds)


def _hf_worker(model, rank: int) -> RolloutWorker:
    return RolloutWorker(
        rank,
        EngineSettings(kind="hf", model_path=str(model), dtype="float32", seed=7),
        "object_store",
        threads=1,
    )


def test_two_hf_engines_sample_differently_and_each_repeats_itself(tiny_model):
    a, b = _hf_worker(tiny_model, 0), _hf_worker(tiny_model, 1)
    first = [r.response_ids for r in a.generate([PROMPT], SAMPLING, 3)]
    other = [r.response_ids for r in b.generate([PROMPT], SAMPLING, 3)]
    assert first != other  # the same prompt on two engines: not the same samples
    again = [r.response_ids for r in a.generate([PROMPT], SAMPLING, 3)]
    assert again == first  # engine 0, same step seed (as after a resume): the same samples
    b2 = [r.response_ids for r in _hf_worker(tiny_model, 1).generate([PROMPT], SAMPLING, 3)]
    assert b2 == other  # a new engine 1 (a replacement, a resume) repeats engine 1


@dataclass
class SeedRecorder:
    """Stands in for an engine of either kind; records the seeds it is given."""

    settings: EngineSettings
    seeds: list[int] = field(default_factory=list)
    tokenizer: object = None
    context_tokens: int | None = None
    concurrent: bool = False  # one call at a time, as `InferenceEngine` says

    def tokenize_chat(self, messages):
        return [1, 2]

    def decode(self, ids):
        return ""

    def generate(self, prompts, sampling):
        self.seeds.append(sampling.seed)
        return [[Sample([3], [-0.5], "stop")] * sampling.n for _ in prompts]

    def close(self):
        pass


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_worker_gives_each_engine_its_own_seed(kind, monkeypatch):
    monkeypatch.setattr(worker_module, "make_engine", lambda s: SeedRecorder(s))
    settings = EngineSettings(kind=kind, model_path="unused", seed=7)
    workers = [RolloutWorker(r, settings, "object_store", threads=1) for r in range(3)]
    # the engine's own seed (vLLM's `LLM(seed=...)`) and every sampling seed, per rank
    assert [w.engine.settings.seed for w in workers] == [engine_seed(7, r) for r in range(3)]
    for w in workers:
        w.generate([PROMPT], SAMPLING, 3)
        w.generate_ids([[1, 2]], SamplingSettings(n=1, max_new_tokens=4, seed=11), 3)
    assert [w.engine.seeds for w in workers] == [
        [engine_seed(300_009, r), engine_seed(11, r)] for r in range(3)
    ]


def test_agent_calls_get_distinct_seeds_per_episode_and_engine(tiny_model, monkeypatch):
    """The OpenAI endpoint of agent episodes: a call without a `seed` samples with one
    derived from its episode id and call index (and the engine's rank), so the
    samples_per_prompt episodes of one prompt do not all repeat seed 0."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(worker_module, "make_engine", lambda s: SeedRecorder(s))
    seen = {}
    for rank in (0, 1):
        w = RolloutWorker(rank, EngineSettings(kind="hf", model_path="unused"), "object_store", 1)
        w.engine.tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        url = w.serve_openai(max_tokens=4, temperature=1.0)
        with httpx.Client(base_url=url, timeout=30) as http:
            for episode in ("s0-p0-0-0", "s0-p0-0-1", "s1-p0-0-0"):
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                http.post(
                    "/chat/completions", json=body, headers={"X-Episode-Id": episode}
                ).raise_for_status()
        w.close()
        seen[rank] = list(w.engine.seeds)
    assert len(set(seen[0])) == 3  # three episodes, three seeds
    assert len(set(seen[0]) | set(seen[1])) == 6  # and none shared between engines
