"""Partial rollouts (`rollout.partial`, actors/partial.py): a weight push during a long
generation keeps every request, the samples resume under the new weights, and each
token records the version that sampled it, with its logprob under that version."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings, Sample
from posttrain.actors.partial import PushGate, generate_partial, version_spans
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.weightsync import TransportSettings
from posttrain.weightsync.filesystem import FilesystemTransport

PROMPTS = [
    PromptRequest("s0-p0", [{"role": "user", "content": "12+30?"}]),
    PromptRequest("s0-p1", [{"role": "user", "content": "7*6?"}]),
]
SAMPLING = SamplingSettings(n=3, max_new_tokens=48, temperature=1.0, seed=11)


def test_version_spans_hand_computed():
    assert version_spans([3, 3, 4]) == [(0, 2, 3), (2, 3, 4)]
    assert version_spans([5]) == [(0, 1, 5)]
    assert version_spans([]) == []
    assert version_spans([1, 2, 2, 1]) == [(0, 1, 1), (1, 3, 2), (3, 4, 1)]


def _worker(model, tmp_path, partial: bool) -> RolloutWorker:
    return RolloutWorker(
        0,
        EngineSettings(kind="hf", model_path=str(model), dtype="float32", seed=7),
        TransportSettings(type="filesystem", directory=str(tmp_path / "weights")),
        threads=1,
        partial=partial,
    )


def test_without_a_push_partial_samples_what_generate_samples(tiny_model, tmp_path):
    plain = _worker(tiny_model, tmp_path, partial=False).generate(PROMPTS, SAMPLING, 0)
    part = _worker(tiny_model, tmp_path, partial=True).generate(PROMPTS, SAMPLING, 0)
    assert [r.response_ids for r in part] == [r.response_ids for r in plain]
    assert [r.inference_logprobs for r in part] == [r.inference_logprobs for r in plain]
    assert all(r.policy_versions == [0] * len(r.response_ids) for r in part)
    assert all(r.policy_versions is None for r in plain)
    assert "policy_versions" not in plain[0].to_dict()


def _logprobs_under(model, prompt: list[int], response: list[int]) -> list[float]:
    """Each response token's log softmax at T = 1 under `model` (fp32)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def test_a_push_mid_generation_keeps_requests_and_tags_versions(tiny_model, tmp_path):
    torch.manual_seed(0)
    w = _worker(tiny_model, tmp_path, partial=True)
    old = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    handle = FilesystemTransport(str(tmp_path / "weights")).send(dict(new.state_dict()), 1)

    forward, calls, pushed = w.engine.model.forward, [0], []

    def counting_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 6:  # the sixth token of the first segment: push from another thread
            t = threading.Thread(target=lambda: pushed.append(w.update_weights(handle, 0)))
            t.start()
            pushed.append(t)
        return forward(*args, **kwargs)

    w.engine.model.forward = counting_forward
    rollouts = w.generate(PROMPTS, SAMPLING, 0)
    pushed[0].join(timeout=60)
    assert pushed[1:] == [1] and w.version == 1

    assert [r.uid for r in rollouts] == [f"s0-p{i}-{k}" for i in range(2) for k in range(3)]
    spanned = 0
    for r in rollouts:
        assert len(r.policy_versions) == len(r.response_ids) == len(r.inference_logprobs)
        assert r.policy_versions == sorted(r.policy_versions)
        assert r.policy_version == r.policy_versions[0] == 0
        assert len(r.response_ids) == 48 or r.finish_reason == "stop"
        cut = r.policy_versions.count(0)
        assert cut >= 5  # the push landed after the fifth token at the earliest
        if cut < len(r.response_ids):
            spanned += 1
            assert version_spans(r.policy_versions) == [
                (0, cut, 0),
                (cut, len(r.response_ids), 1),
            ]
        # each token's logprob is its own version's (fp32, same kernels: 1e-4)
        want_old = _logprobs_under(old, r.prompt_ids, r.response_ids)[:cut]
        want_new = _logprobs_under(new, r.prompt_ids, r.response_ids)[cut:]
        assert r.inference_logprobs == pytest.approx(want_old + want_new, abs=1e-4)
    assert spanned >= 1  # at least one sample ran on across the push


@dataclass
class ScriptedEngine:
    """Returns scripted segments: each call pops one sample per row; records prompts."""

    segments: list[list[Sample]]
    calls: list[tuple[list[list[int]], SamplingSettings]] = field(default_factory=list)

    def generate_interruptible(self, prompts, sampling, interrupt):
        self.calls.append((prompts, sampling))
        rows = self.segments.pop(0)
        return [rows[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_resumed_segments_join_and_respect_the_budget():
    engine = ScriptedEngine(
        [
            # segment 0: two samples of one prompt; the first interrupted after 2 tokens
            [Sample([1, 2], [-0.1, -0.2], "length", True), Sample([3], [-0.3], "stop")],
            # segment 1 (budget 5 - 2 = 3): the engine overshoots nothing
            [Sample([4, 5, 6], [-0.4, -0.5, -0.6], "length")],
        ]
    )
    version = iter([0, 1])
    out = generate_partial(
        engine,
        [[9, 9]],
        SamplingSettings(n=2, max_new_tokens=5, seed=40),
        PushGate(),
        threading.Lock(),
        lambda: next(version),
    )
    first, second = out[0]
    assert first.token_ids == [1, 2, 4, 5, 6]
    assert first.logprobs == [-0.1, -0.2, -0.4, -0.5, -0.6]
    assert first.versions == [0, 0, 1, 1, 1]
    assert (first.finish_reason, second.finish_reason) == ("length", "stop")
    assert second.versions == [0]
    prompts, rest = engine.calls[1]
    assert prompts == [[9, 9, 1, 2]]  # the prompt + the tokens it had
    assert (rest.n, rest.max_new_tokens, rest.seed) == (1, 3, 41)


def test_a_stop_string_across_segments_ends_the_sample():
    # decode: 1 -> 'b', 2 -> 'c'; stop 'bc' spans the boundary of the two segments
    engine = ScriptedEngine(
        [[Sample([0, 1], [-0.1, -0.2], "length", True)], [Sample([2, 3], [-0.3, -0.4], "length")]]
    )
    out = generate_partial(
        engine,
        [[7]],
        SamplingSettings(n=1, max_new_tokens=8, stop=("bc",)),
        PushGate(),
        threading.Lock(),
        lambda: 0,
    )
    (s,) = out[0]
    assert s.token_ids == [0, 1, 2] and s.finish_reason == "stop" and s.versions == [0, 0, 0]


def test_paced_segments_take_one_token_each_and_a_push_between_them_retags():
    """The simulated engine's pacing (`segment_tokens=1`, `pace`): every segment asks for
    one token, a sample cut by the segment's cap (not its own end) is continued, and the
    version read before each segment tags its token."""
    engine = ScriptedEngine(
        [
            [Sample([1], [-0.1], "length"), Sample([2], [-0.2], "stop")],
            [Sample([3], [-0.3], "length")],
            [Sample([4], [-0.4], "length")],
        ]
    )
    version = iter([0, 1, 2])
    paced = []
    out = generate_partial(
        engine,
        [[9]],
        SamplingSettings(n=2, max_new_tokens=3, seed=40),
        PushGate(),
        threading.Lock(),
        lambda: next(version),
        segment_tokens=1,
        pace=lambda: paced.append(1),
    )
    first, second = out[0]
    assert (first.token_ids, first.versions, first.finish_reason) == (
        [1, 3, 4],
        [0, 1, 2],
        "length",
    )
    assert (second.token_ids, second.versions, second.finish_reason) == ([2], [0], "stop")
    assert [s.max_new_tokens for _, s in engine.calls] == [1, 1, 1]
    assert len(paced) == 3  # after each segment
