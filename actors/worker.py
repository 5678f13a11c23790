"""`RolloutWorker`: a Ray actor wrapping one inference engine.

Verbs: `generate`, `update_weights`, `policy_version`, `health`, `drain_spans`.

Concurrency: a worker runs one verb at a time (a plain Ray actor). The controller
calls `update_weights(handle)` after the learner's optimizer step and waits for the
returned `policy_version` before calling `generate` again, so every Rollout of a step
carries the same `policy_version`.
"""

from __future__ import annotations

import time

from actors.engine import InferenceEngine
from actors.rollout import PromptRequest, Rollout, SamplingSettings
from common.process import quiet_libraries, set_torch_threads
from common.telemetry import Span, SpanRecorder
from weightsync import WeightHandle, WeightSyncError, make_transport, state_checksum


def make_engine(kind: str, model_path: str, dtype: str) -> InferenceEngine:
    """The engine for a recipe's `rollout.engine`.

    Raises:
        ValueError: an unknown engine name.
    """
    if kind == "hf":
        from actors.hf_engine import HFEngine

        return HFEngine(model_path, dtype=dtype)
    raise ValueError(f"rollout.engine {kind!r} is not available; use 'hf'")


class RolloutWorker:
    """One rollout engine and the policy_version of the weights it holds."""

    def __init__(
        self,
        worker_id: int,
        engine: str,
        model_path: str,
        dtype: str,
        transport: str,
        threads: int,
        delay_s: float = 0.0,
    ):
        set_torch_threads(threads)
        quiet_libraries()
        self.worker_id = worker_id
        self.engine = make_engine(engine, model_path, dtype)
        self.transport = make_transport(transport)
        self.version = 0
        self.spans = SpanRecorder("rollout", worker_id)
        self.started = time.time()
        self.delay_s = delay_s  # test knob: extra busy time per generate

    def generate(
        self, requests: list[PromptRequest], sampling: SamplingSettings, step: int
    ) -> list[Rollout]:
        """`sampling.n` Rollouts per request, grouped by request order."""
        with self.spans.span("generate", step):
            prompt_ids = [self.engine.tokenize_chat(r.messages) for r in requests]
            groups = self.engine.generate(prompt_ids, sampling)
            time.sleep(self.delay_s)
            rollouts = []
            for req, ids, samples in zip(requests, prompt_ids, groups, strict=True):
                prompt_text = self.engine.decode(ids)
                for k, s in enumerate(samples):
                    rollouts.append(
                        Rollout(
                            uid=f"{req.group_id}-{k}",
                            group_id=req.group_id,
                            prompt_ids=ids,
                            response_ids=s.token_ids,
                            inference_logprobs=s.logprobs,
                            finish_reason=s.finish_reason,
                            policy_version=self.version,
                            prompt_text=prompt_text,
                            response_text=self.engine.decode(s.token_ids),
                            ground_truth=req.ground_truth,
                            metadata=req.metadata,
                        )
                    )
        return rollouts

    def update_weights(self, handle: WeightHandle, step: int) -> int:
        """Load `handle`'s weights in place and take its version; returns the version.

        Raises:
            WeightSyncError: fetching or loading failed, or the checksum differs; names
                this worker and the version. The worker then still reports its old
                version, so the controller sees it is stale.
        """
        with self.spans.span("weight_sync", step):
            try:
                names = self.engine.load_weights(self.transport.receive(handle))
            except (ValueError, WeightSyncError) as e:
                raise WeightSyncError(
                    f"rollout worker {self.worker_id}: loading policy_version {handle.version} "
                    f"failed: {e}"
                ) from e
            if handle.checksum is not None:
                held = self.engine.named_weights()
                got = state_checksum((n, held[n]) for n in names)
                if got != handle.checksum:
                    raise WeightSyncError(
                        f"rollout worker {self.worker_id}: checksum of policy_version "
                        f"{handle.version} differs after loading ({got[:12]} != "
                        f"{handle.checksum[:12]})"
                    )
            self.version = handle.version
        return self.version

    def weights_checksum(self, names: list[str] | None = None) -> str:
        """`state_checksum` of the engine's weights (all, or `names`)."""
        held = self.engine.named_weights()
        return state_checksum((n, held[n]) for n in (names or list(held)))

    def policy_version(self) -> int:
        return self.version

    def health(self) -> dict[str, float | int]:
        return {"worker": self.worker_id, "policy_version": self.version,
                "uptime_s": time.time() - self.started}

    def drain_spans(self) -> list[Span]:
        return self.spans.drain()
