"""`RolloutWorker`: a Ray actor wrapping one inference engine.

Verbs: `generate`, `update_weights`, `policy_version`, `health`, `weights_checksum`,
`drain_spans`, `close`. With a group transport (`collective`) the worker joins the push
group as rank `worker_id + 1` while it is constructed.

Concurrency: a worker runs one verb at a time (a plain Ray actor). The controller
calls `update_weights(handle)` after the learner's optimizer step and waits for the
returned `policy_version` before calling `generate` again, so every Rollout of a step
carries the same `policy_version`.
"""

from __future__ import annotations

import os
import time

from posttrain.actors.engine import EngineSettings
from posttrain.actors.factory import make_engine
from posttrain.actors.rollout import PromptRequest, Rollout, SamplingSettings
from posttrain.common.process import quiet_libraries, set_torch_threads
from posttrain.common.telemetry import Span, SpanRecorder
from posttrain.weightsync import (
    ChecksumTap,
    TransportSettings,
    WeightHandle,
    WeightSyncError,
    make_transport,
    state_checksum,
)


class RolloutWorker:
    """One rollout engine and the policy_version of the weights it holds.

    Args:
        worker_id: index of this engine (rank `worker_id + 1` in a broadcast group).
        engine: how to build the engine.
        transport: how new weights arrive (with a `group_address`, joined here).
        threads: torch threads (cores this worker owns while generating).
        delay_s: test knob, extra busy seconds per generate.
        fail_push: test knob, (worker_id, version): this worker refuses pushes of that
            version (a WeightSyncError), keeping its old weights.
    """

    def __init__(
        self,
        worker_id: int,
        engine: EngineSettings,
        transport: TransportSettings,
        threads: int,
        delay_s: float = 0.0,
        fail_push: tuple[int, int] | None = None,
    ):
        set_torch_threads(threads)
        quiet_libraries()
        self.worker_id = worker_id
        self.engine = make_engine(engine)
        self.transport = make_transport(transport, rank=worker_id + 1)
        self.version = 0
        self.spans = SpanRecorder("rollout", worker_id)
        self.started = time.time()
        self.delay_s = delay_s
        self.fail_push = fail_push

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
                            messages=req.messages,
                        )
                    )
        return rollouts

    def update_weights(self, handle: WeightHandle, step: int = -1) -> int:
        """Load `handle`'s weights in place (or, when `handle.meta` carries an
        `adapter_config`, serve base + that adapter) and take its version; returns it.

        With `handle.checksum`, the tensors are checksummed as they stream in and
        compared with the learner's.

        Raises:
            WeightSyncError: fetching or loading failed, or the checksum differs; names
                this worker and the version. The worker then still reports its old
                version, so the controller sees it is stale.
        """
        with self.spans.span("weight_sync", step):
            if self.fail_push == (self.worker_id, handle.version):
                raise WeightSyncError(f"rollout worker {self.worker_id}: debug.fail_weight_push "
                                      f"refused policy_version {handle.version}")
            try:
                stream = ChecksumTap(self.transport.receive(handle))
                if (adapter := handle.meta.get("adapter_config")) is not None:
                    self.engine.load_adapter(stream, adapter, handle.version)
                else:
                    if handle.names:
                        self.engine.validate_names(handle.names)
                    self.engine.load_weights(stream)
            except (ValueError, RuntimeError) as e:  # WeightSyncError is a RuntimeError
                raise WeightSyncError(
                    f"rollout worker {self.worker_id}: loading policy_version {handle.version} "
                    f"failed: {e}"
                ) from e
            if handle.checksum is not None and (got := stream.checksum()) != handle.checksum:
                raise WeightSyncError(
                    f"rollout worker {self.worker_id}: checksum of policy_version "
                    f"{handle.version} differs after loading ({got[:12]} != "
                    f"{handle.checksum[:12]})"
                )
            self.version = handle.version
        return self.version

    def weights_checksum(self, names: list[str] | None = None) -> str:
        """`state_checksum` of the engine's weights (all, or `names`), in the engine's
        own naming (checkpoint names for 'hf', vLLM's fused names for 'vllm')."""
        held = self.engine.named_weights()
        return state_checksum((n, held[n]) for n in (names or list(held)))

    def policy_version(self) -> int:
        return self.version

    def health(self) -> dict[str, float | int]:
        """Worker index, held policy_version, seconds alive, and the process id (for
        fault drills that kill it)."""
        return {"worker": self.worker_id, "policy_version": self.version,
                "uptime_s": time.time() - self.started, "pid": os.getpid()}

    def drain_spans(self) -> list[Span]:
        return self.spans.drain()

    def close(self) -> None:
        """Release the weight transport's buffers, files and group."""
        self.transport.close()
