"""Partial rollouts (`rollout.partial: true`): a weight push that arrives while a worker
generates pauses the generation at the next token, the new weights load, and the
requests resume from the tokens they hold (as in AReaL, slime and verl's partial
rollouts). No request is dropped; each response token records the policy_version that
sampled it, and its `inference_logprobs` entry is that version's logprob, so the
off-policy correction (algorithms/correction.py) weights every token against the policy
that actually produced it.

Structure:

- `PushGate`: the worker's two threads meet here. The push side (`push()`) raises an
  interrupt the engine polls between tokens and holds back the next segment until the
  weights are loaded; the generating side (`wait_for_push()`) waits between segments.
- `generate_partial`: samples in segments. The first segment is the ordinary batched
  call (`n` samples per prompt, the step's seed), so a run without a push samples
  exactly what `generate` does. Every sample the interrupt cut short is continued as a
  new one-sample request on its prompt + the tokens it has, for the budget left, under
  the seed `seed + segment` (mod 2^32).

Concurrency (the order): a segment runs under the worker's `engine_lock` and reads the
policy_version under it (and appends to the samples under it, so a reader holding the
lock, `RolloutWorker.inflight_prefixes`, sees whole segments); a push sets the
interrupt, takes `engine_lock` once the segment returns, loads, sets the new version
and lowers the interrupt; the next segment starts only after that (`wait_for_push`).
An engine that cannot stop mid-batch (`InferenceEngine.generate_interruptible`'s
default: vLLM's synchronous `LLM`) finishes the segment first: the push then waits
for it, as without partial rollouts.

Pacing (the simulated cluster of bench/async.py, `debug.rollout_delay_s`): segments
of one token each, with the call's delay spread between them outside the lock, so a
push lands mid-sample and calls in flight on one worker overlap as they would on an
engine that batches continuously.

Limits: a continued sample is prefilled again from its prompt + prefix (no KV cache is
kept across a push, the cache would hold the old policy's keys and values); a stop
string that spans two segments is found by decoding the joined response.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from .engine import InferenceEngine, Sample
from .rollout import FinishReason, SamplingSettings


class PushGate:
    """Where a generating thread and a weight push meet on one worker."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pushing = 0
        #: set while a push waits or loads; the engine stops sampling when it sees it.
        self.interrupt = threading.Event()

    @contextmanager
    def push(self) -> Iterator[None]:
        """Push side: raise the interrupt for the body (which takes the engine lock and
        loads); the next segment starts after it."""
        with self.cond:
            self.pushing += 1
            self.interrupt.set()
        try:
            yield
        finally:
            with self.cond:
                self.pushing -= 1
                if self.pushing == 0:
                    self.interrupt.clear()
                self.cond.notify_all()

    def wait_for_push(self) -> None:
        """Generating side: return once no push is waiting or loading."""
        with self.cond:
            self.cond.wait_for(lambda: self.pushing == 0)


@dataclass
class PartialSample:
    """One response built over segments.

    Attributes:
        token_ids: `[R]` sampled token ids.
        logprobs: `[R]` each token's logprob under the version that sampled it.
        versions: `[R]` the policy_version that sampled each token.
        finish_reason: 'stop' or 'length' once done.
        done: False while an interrupt left it short of its end.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (a checkpoint's in-flight prefix); floats round-trip exactly."""
        return {
            "token_ids": list(self.token_ids),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "finish_reason": self.finish_reason,
            "done": self.done,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartialSample:
        """A `to_dict` back, checked: one logprob and one version per token.

        Raises:
            ValueError: the lists differ in length or a logprob is not finite.
        """
        tokens, logprobs, versions = d["token_ids"], d["logprobs"], d["versions"]
        if not len(tokens) == len(logprobs) == len(versions):
            raise ValueError(
                f"a saved prefix has {len(tokens)} tokens, {len(logprobs)} logprobs and "
                f"{len(versions)} versions; each token needs one of each"
            )
        if not all(math.isfinite(x) for x in logprobs):
            raise ValueError("a saved prefix has a non-finite logprob")
        return cls(
            [int(t) for t in tokens],
            [float(x) for x in logprobs],
            [int(v) for v in versions],
            d["finish_reason"],
            bool(d["done"]),
        )


def version_spans(versions: list[int]) -> list[tuple[int, int, int]]:
    """`[R]` per-token versions as spans `(start, end, version)`, end exclusive, in
    order; `[]` for an empty response. `[3, 3, 4]` → `[(0, 2, 3), (2, 3, 4)]`."""
    spans: list[tuple[int, int, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1][2] == v:
            spans[-1] = (spans[-1][0], i + 1, v)
        else:
            spans.append((i, i + 1, v))
    return spans


def _stop_string_end(
    decode: Callable[[list[int]], str], tokens: list[int], start: int, stop: tuple[str, ...]
) -> int | None:
    """Index of the first token at or after `start` whose text completes a stop string."""
    for j in range(start, len(tokens)):
        if any(s in decode(tokens[: j + 1]) for s in stop):
            return j
    return None


def _extend(
    engine: InferenceEngine, ps: PartialSample, s: Sample, version: int, sampling: SamplingSettings
) -> None:
    """Append segment `s` (sampled by `version`) to `ps` and settle whether it is done."""
    start = len(ps.token_ids)
    ps.token_ids += s.token_ids
    ps.logprobs += s.logprobs
    ps.versions += [version] * len(s.token_ids)
    if sampling.stop and start > 0 and s.finish_reason == "length":
        # a stop string across the segment boundary: the engine saw only its segment
        end = _stop_string_end(engine.decode, ps.token_ids, start, sampling.stop)
        if end is not None:
            del ps.token_ids[end + 1 :], ps.logprobs[end + 1 :], ps.versions[end + 1 :]
            ps.finish_reason, ps.done = "stop", True
            return
    if s.interrupted and len(ps.token_ids) < sampling.max_new_tokens:
        return
    ps.finish_reason, ps.done = s.finish_reason, True


def generate_partial(
    engine: InferenceEngine,
    prompts: list[list[int]],
    sampling: SamplingSettings,
    gate: PushGate,
    lock: Any,
    version: Callable[[], int],
    segment_tokens: int | None = None,
    pace: Callable[[], None] | None = None,
    out: list[list[PartialSample]] | None = None,
) -> list[list[PartialSample]]:
    """`sampling.n` samples per prompt `[N][P_i]`, continued across weight pushes.

    Args:
        engine: the worker's engine.
        prompts: prompt token ids.
        sampling: the settings with this engine's seed.
        gate: the worker's `PushGate`.
        lock: the worker's engine lock (held for each segment).
        version: the policy_version the engine holds (read under `lock`).
        segment_tokens: most tokens per segment (None: a segment runs until a push
            interrupts it). With `pace`, the simulated cluster's time between tokens.
        pace: called after each segment, outside the lock (the simulated cluster's
            generation time, `debug.rollout_delay_s`: a push may land while it runs).
        out: `[N][n]` samples to fill, the caller's (read between segments); a row with
            tokens or a done sample (a resume's) skips the first segment. None: fresh.

    Returns:
        `out`: result[i] holds prompt i's samples in order, every one done.
    """
    if out is None:
        out = [[PartialSample() for _ in range(sampling.n)] for _ in prompts]
    # rows that hold nothing yet take the first, batched segment (the step's seed)
    fresh = [i for i, row in enumerate(out) if not any(ps.token_ids or ps.done for ps in row)]

    def capped(s: SamplingSettings, budget: int) -> SamplingSettings:
        return replace(
            s, max_new_tokens=budget if segment_tokens is None else min(budget, segment_tokens)
        )

    def cut(s: Sample, cap: int) -> Sample:
        # a sample stopped by the segment's cap, not its own end, is to be continued
        if segment_tokens is not None and s.finish_reason == "length" and len(s.token_ids) >= cap:
            return replace(s, interrupted=True)
        return s

    first = capped(sampling, sampling.max_new_tokens)
    if fresh:
        gate.wait_for_push()
        with lock:
            v = version()
            groups = engine.generate_interruptible(
                [prompts[i] for i in fresh], first, gate.interrupt
            )
            for i, samples in zip(fresh, groups, strict=True):  # under the lock: `out` is read
                for ps, s in zip(out[i], samples, strict=True):
                    _extend(engine, ps, cut(s, first.max_new_tokens), v, sampling)
        if pace is not None:
            pace()
    segment = 0
    while todo := [(i, ps) for i, row in enumerate(out) for ps in row if not ps.done]:
        segment += 1
        gate.wait_for_push()
        rest = capped(
            replace(sampling, n=1, seed=(sampling.seed + segment) % 2**32),
            sampling.max_new_tokens - min(len(ps.token_ids) for _, ps in todo),
        )
        with lock:
            v = version()
            groups = engine.generate_interruptible(
                [prompts[i] + ps.token_ids for i, ps in todo], rest, gate.interrupt
            )
            for (_, ps), (s,) in zip(todo, groups, strict=True):
                budget = sampling.max_new_tokens - len(ps.token_ids)
                if len(s.token_ids) > budget:  # the batch's budget is its shortest sample's
                    s = Sample(s.token_ids[:budget], s.logprobs[:budget], "length")
                _extend(engine, ps, cut(s, rest.max_new_tokens), v, sampling)
        if pace is not None:
            pace()
    return out
