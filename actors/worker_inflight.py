"""Partial rollouts on `RolloutWorker` (actors/worker.py): `generate` in segments with a
push gate (actors/partial.py), and what a checkpoint saves of the samples in flight.

In flight: every request `generate` runs registers its rows of `PartialSample`s under
its group id while it runs. `inflight_prefixes` raises the push gate's interrupt (as a
push does), takes the engine lock once the segment in flight has returned, copies each
registered sample (its tokens, `inference_logprobs`, per-token versions, whether it is
done) and lowers the interrupt: generation then goes on where it stopped. A request
that carries `prefixes` (a resume) starts from them: its samples hold the saved tokens,
logprobs and versions as they were and are continued from prompt + those tokens with
the budget left (`max_new_tokens` − the prefix's length), so the prefix of every
continued sample is the killed run's by construction.

Which engines: those that generate in segments under the gate ('hf', vLLM's
synchronous `LLM`, which finishes its batch before the interrupt is seen, so the copy
waits for it). vLLM's AsyncLLM pauses its own requests and keeps their tokens inside
the engine: `inflight_prefixes` returns None there (the controller then regenerates
those prompts and says so).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ..common.telemetry import SpanRecorder
from .debug import DebugSettings
from .engine import InferenceEngine, check_prompt_lengths
from .partial import PartialSample, PushGate, generate_partial
from .rollout import PromptRequest, Rollout, SamplingSettings


class InflightSamples:
    """Mixin of `RolloutWorker`, which sets the attributes below."""

    worker_id: int
    engine: InferenceEngine
    engine_lock: threading.Lock
    spans: SpanRecorder
    debug: DebugSettings
    gate: PushGate | None
    version: int

    def inflight_prefixes(self) -> dict[str, list[dict[str, Any]]] | None:
        """Each request in flight's samples as they stand, `{group_id: [n × dict]}`
        (`PartialSample.to_dict`: token ids, logprobs, versions, finish_reason, done);
        None where this engine keeps them out of reach (no push gate: vLLM's AsyncLLM,
        or no partial rollouts). Generation pauses between tokens while they are read."""
        if self.gate is None:
            return None
        with self.gate.push(), self.engine_lock:
            rows = dict(self._inflight_rows())
            return {gid: [ps.to_dict() for ps in row] for gid, row in rows.items()}

    def _inflight_rows(self) -> dict[str, list[PartialSample]]:
        if not hasattr(self, "_rows"):
            self._rows: dict[str, list[PartialSample]] = {}
        return self._rows

    def _generate_partial(
        self, gate: PushGate, requests: list[PromptRequest], sampling: SamplingSettings, step: int
    ) -> list[Rollout]:
        """`generate` with partial rollouts: the engine lock is held per segment, so a
        push may load between two (actors/partial.py). With the `debug.delay_s` knob the
        call is paced as a simulated engine generating token by token: one token per
        segment, the call's delay spread between them outside the lock, so a push lands
        mid-sample and calls in flight on this worker overlap (continuous batching).

        Raises:
            ValueError: a prompt leaves no room in the engine's context, or a request's
                `prefixes` are not `sampling.n` well-formed samples.
        """
        with self.spans.span("generate", step):
            with self.engine_lock:
                self._check_adapter()
            prompt_ids = [self.engine.tokenize_chat(r.messages) for r in requests]
            check_prompt_lengths(prompt_ids, self.engine.context_tokens)
            seeded = self._own_seed(sampling)
            rows = [_start_row(r, seeded) for r in requests]
            registry = self._inflight_rows()
            with self.engine_lock:
                registry.update({r.group_id: row for r, row in zip(requests, rows, strict=True)})
            delay = self.debug.generate_delay(requests, sampling.n)
            try:
                groups = generate_partial(
                    self.engine,
                    prompt_ids,
                    seeded,
                    gate,
                    self.engine_lock,
                    lambda: self.version,
                    segment_tokens=1 if delay else None,
                    pace=(lambda: time.sleep(delay / sampling.max_new_tokens)) if delay else None,
                    out=rows,
                )
            finally:
                with self.engine_lock:  # an abandoned request's id may be reused: its own
                    for r, row in zip(requests, rows, strict=True):
                        if registry.get(r.group_id) is row:
                            del registry[r.group_id]
            return [
                self._rollout(req, ids, k, s.token_ids, s.logprobs, s.finish_reason, s.versions)
                for req, ids, samples in zip(requests, prompt_ids, groups, strict=True)
                for k, s in enumerate(samples)
            ]

    if TYPE_CHECKING:  # RolloutWorker's

        def _check_adapter(self) -> None: ...
        def _own_seed(self, sampling: SamplingSettings) -> SamplingSettings: ...
        def _rollout(self, *args: Any) -> Rollout: ...


def _start_row(req: PromptRequest, sampling: SamplingSettings) -> list[PartialSample]:
    """`sampling.n` samples for `req`: fresh, or its saved `prefixes` (a resume); a prefix
    at or past `max_new_tokens` (a resume that lowered it) ends there, as 'length'.

    Raises:
        ValueError: `prefixes` has another count than `sampling.n`, or a malformed one.
    """
    if req.prefixes is None:
        return [PartialSample() for _ in range(sampling.n)]
    if len(req.prefixes) != sampling.n:
        raise ValueError(
            f"request {req.group_id} carries {len(req.prefixes)} saved samples, and "
            f"rollout.samples_per_prompt is {sampling.n}; resume with the checkpoint's "
            "samples_per_prompt"
        )
    row = [PartialSample.from_dict(d) for d in req.prefixes]
    cap = sampling.max_new_tokens
    for ps in row:
        if not ps.done and len(ps.token_ids) >= cap:
            del ps.token_ids[cap:], ps.logprobs[cap:], ps.versions[cap:]
            ps.finish_reason, ps.done = "length", True
    return row
