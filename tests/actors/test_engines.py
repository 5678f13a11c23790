"""One suite for every engine behind `RolloutWorker` ('hf', 'vllm' and 'vllm_async',
vLLM's AsyncLLM): groups, finish
reasons, seeds, stop strings and stop tokens, logprobs that the learner reproduces
(importance ratio 1 on unchanged weights, fp32), samples drawn from the learner's
distribution, and refusal of pushes that would leave stale weights.

The model under test is hostile on purpose: its generation_config.json sets sampling
parameters of its own (a repetition penalty of 5, top_k, min_p, ...) which an engine
must ignore, and its tokenizer EOS (`<|endoftext|>`), generation-config EOS (`<|eot|>`)
and chat-template end of turn (`<|im_end|>`) are three different tokens, all of which
must end a sample."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import SamplingSettings
from posttrain.learner.logprobs import sequence_logprobs
from tests.engine_host import RemoteEngine, requires_vllm
from tests.tiny_model import CHARS, SPECIALS, build_tiny_model

KINDS = [
    "hf",
    pytest.param("vllm", marks=[pytest.mark.vllm, requires_vllm]),
    pytest.param("vllm_async", marks=[pytest.mark.vllm, requires_vllm]),
]
EOS, EOT, END_OF_TURN = "<|endoftext|>", "<|eot|>", "<|im_end|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Llama at head_dim 32 (vLLM's CPU kernels), with the hostile files."""
    eot = len(SPECIALS) + len(CHARS) + 1  # the second extra special token
    return build_tiny_model(
        tmp_path_factory.mktemp("hostile") / "model",
        hidden=128,
        max_positions=1024,
        eos_token=EOS,
        extra_specials=(EOS, EOT),
        generation_config={
            "eos_token_id": [eot],
            "repetition_penalty": 5.0,
            "no_repeat_ngram_size": 2,
            "min_p": 0.2,
            "top_k": 3,
            "top_p": 0.5,
            "temperature": 0.3,
        },
    )


@pytest.fixture(scope="module")
def stop_ids(model_dir) -> dict[str, int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return {t: tok.convert_tokens_to_ids(t) for t in (EOS, EOT, END_OF_TURN)}


@pytest.fixture(scope="module", params=KINDS)
def engine(request, ray_local, model_dir):
    e = RemoteEngine(EngineSettings(kind=request.param, model_path=str(model_dir), dtype="float32"))
    e.kind = request.param
    yield e
    e.kill()


def _prompt(engine, text):
    return engine.tokenize_chat([{"role": "user", "content": text}])


def test_groups_and_lengths(engine, stop_ids):
    prompts = [_prompt(engine, q) for q in ("1+1", "22+3")]
    out = engine.generate(prompts, SamplingSettings(n=3, max_new_tokens=5, seed=1))
    assert [len(g) for g in out] == [3, 3]
    for group in out:
        for s in group:
            assert 1 <= len(s.token_ids) <= 5
            assert len(s.logprobs) == len(s.token_ids)
            ended = s.token_ids[-1] in stop_ids.values()
            assert s.finish_reason == ("stop" if ended else "length")
            assert all(lp <= 0 for lp in s.logprobs)


def test_same_seed_same_samples(engine, request):
    if engine.kind == "vllm_async":
        # On CPU AsyncLLM's seed is the engine core's global generator, set by an RPC
        # before the requests arrive; the core's busy loop can draw from it in between
        # (seen once under load in the full suite). Per-request seeds are CUDA-only.
        request.applymarker(pytest.mark.xfail(reason="CPU AsyncLLM seeds are global", strict=False))
    p = [_prompt(engine, "abc")]
    a = engine.generate(p, SamplingSettings(n=2, max_new_tokens=6, seed=7))
    b = engine.generate(p, SamplingSettings(n=2, max_new_tokens=6, seed=7))
    c = engine.generate(p, SamplingSettings(n=2, max_new_tokens=6, seed=8))
    assert [s.token_ids for s in a[0]] == [s.token_ids for s in b[0]]
    assert [s.token_ids for s in a[0]] != [s.token_ids for s in c[0]]


def test_stop_string_ends_the_sample(engine, stop_ids):
    # A random model emits most characters within 40 tokens; stop at a common one.
    p = [_prompt(engine, "go")]
    free = engine.generate(p, SamplingSettings(n=4, max_new_tokens=40, seed=2))[0]
    text = engine.decode(free[0].token_ids)
    stop = next(ch for ch in text[3:] if ch.isalnum())
    out = engine.generate(p, SamplingSettings(n=4, max_new_tokens=40, seed=2, stop=(stop,)))[0]
    ends = set(stop_ids.values())
    for s in out:
        decoded = engine.decode(s.token_ids)
        if s.finish_reason == "stop" and s.token_ids[-1] not in ends:
            assert decoded.endswith(stop) and stop not in decoded[: -len(stop)]
        else:
            assert stop not in decoded
    assert any(s.finish_reason == "stop" and s.token_ids[-1] not in ends for s in out)


def test_stop_token_ids_end_the_sample_where_it_samples_one(engine):
    """`SamplingSettings.stop_token_ids` (the service's `stop` as ids): the same seed
    samples the same tokens up to the first stop id, which ends the sample and stays in
    it, its logprob the same (one request: nothing else in the batch moves the seed)."""
    p = [_prompt(engine, "go")]
    for seed in range(10):
        free = engine.generate(p, SamplingSettings(n=1, max_new_tokens=30, seed=seed))[0][0]
        if len(free.token_ids) >= 4:
            break
    k = free.token_ids.index(free.token_ids[2])  # the first place its token is sampled
    stopped = engine.generate(
        p,
        SamplingSettings(n=1, max_new_tokens=30, seed=seed, stop_token_ids=(free.token_ids[k],)),
    )[0][0]
    assert stopped.token_ids == free.token_ids[: k + 1]
    assert stopped.finish_reason == "stop"
    torch.testing.assert_close(
        torch.tensor(stopped.logprobs), torch.tensor(free.logprobs[: k + 1]), rtol=0, atol=1e-6
    )
    with pytest.raises(ValueError, match="stop token ids must be token ids"):
        engine.generate(p, SamplingSettings(n=1, max_new_tokens=4, stop_token_ids=(-1,)))


def test_empty_stop_string_is_refused(engine):
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        engine.generate(
            [_prompt(engine, "go")], SamplingSettings(n=1, max_new_tokens=4, stop=("",))
        )


def test_context_tokens_is_the_models(engine):
    """What the agent endpoint and the workers check prompts against (1024 positions)."""
    assert engine.attr("context_tokens") == 1024


def test_every_end_of_sequence_token_ends_the_sample(engine, stop_ids):
    """Tokenizer EOS, generation-config EOS and template end of turn all stop a sample
    (an engine stopping on one of them only let samples run past the others)."""
    out = engine.generate(
        [_prompt(engine, "hello")], SamplingSettings(n=64, max_new_tokens=40, seed=4)
    )[0]
    ends = set(stop_ids.values())
    for s in out:
        inside = [t for t in s.token_ids[:-1] if t in ends]
        assert not inside, f"sample ran past end token(s) {inside}"
        assert s.finish_reason == ("stop" if s.token_ids[-1] in ends else "length")
    ended_by = {s.token_ids[-1] for s in out if s.finish_reason == "stop"}
    assert ended_by == ends  # each of the three ended some sample: the test is not vacuous


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_learner_reproduces_inference_logprobs(engine, model_dir, temperature):
    prompt = _prompt(engine, "7+8")
    sample = engine.generate(
        [prompt], SamplingSettings(n=1, max_new_tokens=12, temperature=temperature, seed=3)
    )[0][0]
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        lp = sequence_logprobs(learner, ids, torch.ones_like(ids), len(prompt), temperature)
    ratio = torch.exp(lp[0, len(prompt) :] - torch.tensor(sample.logprobs))
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)


def test_samples_follow_the_learners_distribution(engine, model_dir):
    """The model's repetition penalty (5) must not shape sampling. Statistic: at each
    sampled position, whether the token already occurred (prompt or response so far),
    against the learner's probability of that set under softmax(logits / T). Under the
    learner's distribution the sum of (indicator - probability) has mean 0 and variance
    sum p(1-p), exactly; a penalised sampler repeats far less (z = -7.2 with `engine: hf`
    before the fix, |z| < 1 after on both engines). Seeds are fixed: deterministic."""
    prompt = _prompt(engine, "7+8")
    out = engine.generate([prompt], SamplingSettings(n=128, max_new_tokens=32, seed=5))[0]
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen_n, mean, var = 0, 0.0, 0.0
    for s in out:
        with torch.no_grad():
            logits = learner(torch.tensor([prompt + s.token_ids])).logits[0]
        probs = logits[len(prompt) - 1 : -1].softmax(-1)  # [R, V], T = 1
        for t, tok in enumerate(s.token_ids):
            seen = sorted(set(prompt + s.token_ids[:t]))
            p = probs[t, seen].sum().item()
            seen_n, mean, var = seen_n + (tok in seen), mean + p, var + p * (1 - p)
    z = (seen_n - mean) / math.sqrt(var)
    assert abs(z) < 4, f"repeated tokens {seen_n}, expected {mean:.0f} (z {z:.1f})"


def test_load_weights_rejects_unknown_and_partial(engine, model_dir):
    with pytest.raises(ValueError, match="not a parameter|not parameters"):
        engine.load_weights([("nope.weight", torch.zeros(1))])
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    name = "model.norm.weight"
    if engine.kind in ("vllm", "vllm_async"):  # refused before loading anything
        with pytest.raises(ValueError, match="would keep old values"):
            engine.validate_names([name])
    else:
        with pytest.raises(ValueError, match="would keep old values"):
            engine.load_weights([(name, full.state_dict()[name].clone())])


def test_many_long_prompts_in_one_batch(engine):
    """More prefill tokens than one scheduler step takes (vLLM then chunks prefills and
    discards partial samples; with per-request CPU generators that crashed)."""
    prompts = [_prompt(engine, f"{i} " + "the lazy dog jumps " * 30) for i in range(24)]
    out = engine.generate(prompts, SamplingSettings(n=4, max_new_tokens=3, seed=1))
    assert [len(g) for g in out] == [4] * 24
    assert all(1 <= len(s.token_ids) <= 3 for g in out for s in g)


def test_a_stream_failing_part_way_is_never_served_silently(engine, model_dir):
    """Keep last: a vLLM engine whose reload was interrupted refuses to sample."""
    if engine.kind == "vllm_async":  # the push is checked whole before anything loads
        good = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        bad = [(n, t[:1] if n == "model.norm.weight" else t) for n, t in good.state_dict().items()]
        with pytest.raises(RuntimeError, match="restart this engine"):
            engine.load_weights(bad)
        with pytest.raises(RuntimeError, match="restart this engine"):
            engine.generate([_prompt(engine, "hi")], SamplingSettings(n=1, max_new_tokens=2))
        return
    if engine.kind != "vllm":
        pytest.skip("the HF engine copies tensor by tensor; nothing is half loaded")
    with pytest.raises(ValueError, match="not a parameter"):
        engine.load_weights(iter([("nope.weight", torch.zeros(1))]))
    with pytest.raises(RuntimeError, match="restart this engine"):
        engine.generate([_prompt(engine, "hi")], SamplingSettings(n=1, max_new_tokens=2))
