"""No two samples of a run share a seed (issue 47): vLLM seeds child k of a request
`seed + k`, and prompt i of a call had `seed + i`, so the same prompt twice in a call
gave 3 of its 4 samples twice (and step seeds, 1 apart, shifted steps onto each other).
Checked on the seeds of a whole run's requests (steps, rounds, engines, refill groups,
episode turns, evaluation's pass@k groups) through vLLM's own child rule, and on real
engines: the same prompt twice in one call gives all-distinct samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.actors.engine import EngineSettings, engine_seed, request_seed
from posttrain.actors.rollout import SamplingSettings
from tests.engine_host import EngineHost, RemoteEngine, requires_vllm


def test_request_seed_hand_computed():
    # BLAKE2b-64 of b"300009:1" is 0x39b07a804e8a1dfd; >> 2 keeps 62 bits
    assert request_seed(300_009, 1) == 0x39B07A804E8A1DFD >> 2
    assert request_seed(300_009, 1) == request_seed(300_009, 1)  # a resume repeats
    assert all(0 <= request_seed(s, i) < 2**62 for s in range(50) for i in range(50))


def _child_seeds(params) -> list[int]:
    """The seeds vLLM gives the n children of each request (its own `ParentRequest`)."""
    from vllm.v1.engine.parallel_sampling import ParentRequest

    out = []
    for p in params:
        parent = ParentRequest(SimpleNamespace(request_id="r", external_req_id="r", params=p))
        out += [parent.get_child_info(k)[1].seed for k in range(p.n)]
    return out


def _run_seeds(calls: list[tuple[int, int, int]]) -> list[int]:
    """Every sample's seed over `(call seed, prompts, n)` calls, as vLLM on cuda seeds
    them (`sampling_params`, then vLLM's child rule)."""
    from posttrain.actors.vllm_engine import sampling_params

    seeds = []
    for seed, prompts, n in calls:
        s = SamplingSettings(n=n, max_new_tokens=4, seed=seed)
        seeds += _child_seeds(sampling_params(s, prompts, [0], per_request_seed=True))
    return seeds


BASE = 7 * 100_003  # train.seed 7 (controller.py: seed·100003 + step + 1000003·round)


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize(
    "run",
    [
        # whole steps: 16 prompts (duplicates among them), 8 samples each, 2 engines,
        # 20 steps of 2 rounds (dynamic sampling)
        [
            (engine_seed(BASE + step + 1_000_003 * round_, rank), 16, 8)
            for step in range(20)
            for round_ in range(2)
            for rank in range(2)
        ],
        # the refill producer: each group its own request, seed + 7919·j (async_loop.py)
        [(engine_seed(BASE + r + 7919 * j, 0), 1, 8) for r in range(10) for j in range(16)],
        # episodes: one sample per episode and turn, seed + 7919·turn (multiturn.py)
        [(engine_seed(BASE + step + 7919 * t, 0), 16, 1) for step in range(20) for t in range(4)],
        # evaluation's pass@k: 16 prompts, k = 8, its own seed, on 2 engines
        [(engine_seed(0, rank), 16, 8) for rank in range(2)],
    ],
    ids=["steps", "refill", "episodes", "pass_at_k"],
)
def test_no_two_samples_of_a_run_share_a_seed(run):
    seeds = _run_seeds(run)
    assert len(set(seeds)) == len(seeds)


def test_request_seeds_of_one_call_differ_by_more_than_n():
    seeds = sorted(request_seed(12_345, i) for i in range(1000))
    assert min(b - a for a, b in zip(seeds, seeds[1:], strict=False)) > 1024


class SeededHost(EngineHost):
    """Test-only: per-request seeds, as vLLM on cuda runs (CPU vLLM seeds its global
    generator instead; short prompts never hit the chunked-prefill rewind that rules
    per-request seeds out on CPU)."""

    def __init__(self, settings: EngineSettings):
        super().__init__(settings)
        self.engine.per_request_seed = True


KINDS = ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, requires_vllm])]


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_prompt_twice_in_a_call_gives_distinct_samples(ray_local, tiny_model_vllm, kind):
    import ray

    settings = EngineSettings(kind=kind, model_path=str(tiny_model_vllm), dtype="float32")
    engine = RemoteEngine.__new__(RemoteEngine)
    engine.actor = ray.remote(num_cpus=0)(SeededHost if kind == "vllm" else EngineHost).remote(
        settings
    )
    try:
        p = engine.tokenize_chat([{"role": "user", "content": "2+2?"}])
        out = engine.generate(
            [p, p, p], SamplingSettings(n=4, max_new_tokens=12, temperature=1.0, seed=300_009)
        )
        samples = [tuple(s.token_ids) for g in out for s in g]
        assert len(samples) == 12
        assert len(set(samples)) == 12  # seed + i: seeds S..S+5, 6 distinct
    finally:
        engine.kill()
