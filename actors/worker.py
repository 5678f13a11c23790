"""`RolloutWorker`: a Ray actor wrapping one inference engine.

Verbs: `generate`, `generate_ids` (token ids in, samples out: the turns of multi-turn
episodes), `inflight_prefixes` (what a checkpoint saves of the samples in flight,
actors/worker_inflight.py), `update_weights`, `delivery`, `join_push_group`,
`policy_version`, `health`, `weights_checksum`, `drain_spans`, `close`; for many LoRA
sessions on one base, named adapters (`drop_adapter`, `adapters`;
actors/worker_push.py); for black-box agents
`serve_openai` (an OpenAI-compatible endpoint, actors/openai_server.py) and
`pop_episode` (its recorded calls). With a group transport (`collective`) the worker
joins the push group as rank `worker_id + 1` while it is constructed (when the settings
carry a `group_address`), and again on `join_push_group` when the controller re-forms
the group after a member was replaced.

Concurrency: a worker runs one verb at a time (a plain Ray actor); the OpenAI
endpoint's server threads share the engine under `engine_lock`, the calls of several
episodes sampled together (actors/call_batcher.py). The controller
calls `update_weights(handle)` after the learner's optimizer step and waits for the
returned `policy_version` before calling `generate` again, so every Rollout of a step
carries the same `policy_version`. With partial rollouts (`partial=True`, started as a
threaded actor) `update_weights` may run while `generate` does: it interrupts the
generation, loads, and the generation resumes under the new version
(actors/partial.py); each Rollout then records the version of every token.

A `concurrent` engine (vLLM's AsyncLLM, actors/vllm_async.py) takes no engine lock to
sample: `generate`, `generate_ids` and the endpoint's calls run at once and are batched
together; `update_weights` still holds `engine_lock` (one push at a time) and the engine
itself pauses the requests in flight while it loads, keeping them. With partial rollouts
the Rollouts then carry the engine's per-token versions; without, no push overlaps a
`generate` (the controller waits, the actor runs one verb at a time).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

from ..common.process import quiet_libraries, set_torch_threads
from ..common.telemetry import Span, SpanRecorder
from ..weightsync import (
    Delivery,
    DeltaReceiver,
    TransportSettings,
    WeightHandle,
    WeightSyncError,
    make_transport,
    state_checksum,
)
from .call_batcher import CallBatcher
from .debug import DebugSettings
from .engine import EngineSettings, Sample, check_prompt_lengths, engine_seed
from .factory import make_engine
from .openai_server import EpisodeRecorder, create_app
from .partial import PushGate
from .rollout import FinishReason, PromptRequest, Rollout, SamplingSettings
from .worker_inflight import InflightSamples
from .worker_push import PushReceiving


class RolloutWorker(PushReceiving, InflightSamples):
    """One rollout engine and the policy_version of the weights it holds. The engine
    samples with seeds of its own: the engine seed and every sampling seed it is sent go
    through `engine_seed(seed, worker_id)`, so engines never repeat each other.

    Args:
        worker_id: index of this engine (rank `worker_id + 1` in a broadcast group).
        engine: how to build the engine.
        transport: how new weights arrive (with a `group_address`, joined here).
        threads: torch threads (cores this worker owns while generating).
        partial: partial rollouts (`rollout.partial`): a push pauses `generate` between
            tokens and the requests resume under the new weights; the actor must then run
            with `max_concurrency` ≥ 2 so the push reaches it while it generates.
        debug: test and benchmark knobs (actors/debug.py); None: all off.
    """

    def __init__(
        self,
        worker_id: int,
        engine: EngineSettings,
        transport: TransportSettings | str,
        threads: int,
        partial: bool = False,
        debug: DebugSettings | None = None,
    ):
        set_torch_threads(threads)
        quiet_libraries()
        self.worker_id = worker_id
        # each engine samples with seeds of its own (actors/engine.py `engine_seed`)
        self.engine = make_engine(replace(engine, seed=engine_seed(engine.seed, worker_id)))
        if isinstance(transport, str):  # just a type name (tests, benches)
            transport = TransportSettings(type=transport)
        self.transport_settings = transport
        self.transport = make_transport(transport, rank=worker_id + 1)
        self.version = 0
        # weight_sync.delta: the copy of the last push a delta is applied to
        self.delta = DeltaReceiver() if transport.delta else None
        self.delivered = Delivery(-1)  # the last verified push's account
        self.named_delivered: dict[str, Delivery] = {}  # named adapters' (worker_push.py)
        self.adapter_version: int | None = None  # the adapter generate must run with
        self.spans = SpanRecorder("rollout", worker_id)
        self.started = time.time()
        self.debug = debug if debug is not None else DebugSettings()
        self.engine_lock = threading.Lock()  # the OpenAI endpoint's threads share the engine
        self.recorder: EpisodeRecorder | None = None
        self.batcher: CallBatcher | None = None  # the endpoint's calls, batched
        self.endpoint_step = -1  # the step its engine calls' spans are tagged with
        self.server = None
        self.partial = partial
        # a concurrent engine pauses its own requests on a push: no segments, no gate
        self.gate = PushGate() if partial and not self.engine.concurrent else None

    def generate(
        self, requests: list[PromptRequest], sampling: SamplingSettings, step: int
    ) -> list[Rollout]:
        """`sampling.n` Rollouts per request, grouped by request order.

        Raises:
            ValueError: a prompt leaves no room in the engine's context.
        """
        if self.gate is not None:
            return self._generate_partial(self.gate, requests, sampling, step)
        with self.spans.span("generate", step), self._sampling_lock():
            self._check_adapter()
            prompt_ids = [self.engine.tokenize_chat(r.messages) for r in requests]
            check_prompt_lengths(prompt_ids, self.engine.context_tokens)
            groups = self.engine.generate(prompt_ids, self._own_seed(sampling))
            time.sleep(self.debug.generate_delay(requests, sampling.n))
            return [
                self._rollout(
                    req,
                    ids,
                    k,
                    s.token_ids,
                    s.logprobs,
                    s.finish_reason,
                    s.versions if self.partial else None,
                )
                for req, ids, samples in zip(requests, prompt_ids, groups, strict=True)
                for k, s in enumerate(samples)
            ]

    def _sampling_lock(self) -> AbstractContextManager[object]:
        """What a sampling call holds: nothing on a `concurrent` engine (calls batch
        together, pushes pause them), else `engine_lock` (one call at a time)."""
        return nullcontext() if self.engine.concurrent else self.engine_lock

    def _rollout(
        self,
        req: PromptRequest,
        ids: list[int],
        k: int,
        tokens: list[int],
        logprobs: list[float],
        finish: FinishReason,
        versions: list[int] | None,
    ) -> Rollout:
        """Sample `k` of `req` as a Rollout; `versions` per token with partial rollouts
        (its `policy_version` is then the first token's, else the engine's now)."""
        return Rollout(
            uid=f"{req.group_id}-{k}",
            group_id=req.group_id,
            prompt_ids=ids,
            response_ids=tokens,
            inference_logprobs=logprobs,
            finish_reason=finish,
            policy_version=versions[0] if versions else self.version,
            prompt_text=self.engine.decode(ids),
            response_text=self.engine.decode(tokens),
            ground_truth=req.ground_truth,
            metadata=req.metadata,
            messages=req.messages,
            policy_versions=versions,
        )

    def generate_ids(
        self,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        step: int,
        adapter: str | None = None,
    ) -> tuple[list[Sample], int]:
        """`sampling.n` samples per prompt `[N][P_i]` (token ids, already templated),
        prompt-major (`[N * n]`: prompt 0's n, then prompt 1's, ...), and the
        policy_version that sampled them. With `adapter`, sampled by base + that named
        adapter (actors/worker_push.py), and the version is the adapter's.

        Raises:
            ValueError: a prompt leaves no room in the engine's context (checked before
                the engine), or `adapter` is not held (unknown, dropped or evicted: the
                message names it).
        """
        check_prompt_lengths(prompts, self.engine.context_tokens)
        with self.spans.span("generate", step), self._sampling_lock():
            if adapter is not None:
                groups, version = self._generate_named(prompts, self._own_seed(sampling), adapter)
            else:
                self._check_adapter()
                version = self.version
                groups = self.engine.generate(prompts, self._own_seed(sampling))
        return [sample for g in groups for sample in g], version

    def _check_adapter(self) -> None:
        """Refuse to sample without the adapter last pushed (adapter-only sync): a
        request on the base model or a stale adapter would train on the wrong policy.

        Raises:
            WeightSyncError: names this worker and both versions.
        """
        if self.adapter_version is None:
            return
        active = self.engine.active_adapter()
        if active != self.adapter_version:
            raise WeightSyncError(
                f"rollout worker {self.worker_id}: the adapter of policy_version "
                f"{self.adapter_version} was pushed, but this request would run with "
                f"{'no adapter' if active is None else f'the adapter of {active}'}"
            )

    def _own_seed(self, sampling: SamplingSettings) -> SamplingSettings:
        """`sampling` with this engine's seed (`engine_seed` of its seed and the rank):
        the controller sends every engine the same settings."""
        return replace(sampling, seed=engine_seed(sampling.seed, self.worker_id))

    def serve_openai(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_tokens: int = 256,
        temperature: float | None = None,
        step: int = -1,
    ) -> str:
        """Start the OpenAI-compatible endpoint (once) on a server thread; its base URL
        (`http://host:port/v1`). With `temperature` (training) every call samples at it
        and at most `max_tokens` tokens; prompts are checked against the engine's
        context (see `openai_server.create_app`). Calls of several episodes at once are
        sampled together (`CallBatcher`; a concurrent engine batches them itself), each
        engine call a `generate` span of `step` (the step calling; its idle metric)."""
        self.endpoint_step = step
        if self.server is None:
            import socket

            import uvicorn

            self.recorder = EpisodeRecorder()
            if self.engine.concurrent:  # the engine batches concurrent calls itself
                generate = self._endpoint_call
            else:
                self.batcher = CallBatcher(self._endpoint_batch)
                generate = self.batcher.generate
            app = create_app(
                generate,
                self.engine.tokenizer,
                self.recorder,
                max_tokens,
                temperature,
                self.engine.context_tokens,
            )
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port, again
            sock.bind((host, port))
            self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            threading.Thread(
                target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
            ).start()
            while not self.server.started:
                time.sleep(0.01)
            self.openai_url = f"http://{host}:{sock.getsockname()[1]}/v1"
        return self.openai_url

    def _endpoint_batch(
        self, prompts: list[list[int]], sampling: SamplingSettings
    ) -> tuple[list[Sample], int]:
        """The endpoint's calls of one batch (n = 1 each) on the engine, and the
        policy_version that sampled them."""
        with self.spans.span("generate", self.endpoint_step), self._sampling_lock():
            self._check_adapter()
            version = self.version
            groups = self.engine.generate(prompts, self._own_seed(sampling))
        return [g[0] for g in groups], version

    def _endpoint_call(self, ids: list[int], sampling: SamplingSettings) -> tuple[Sample, int]:
        """One endpoint call on a concurrent engine (the engine batches the calls): a
        call may span a push, so its version is its first token's."""
        (sample,), version = self._endpoint_batch([ids], sampling)
        return sample, sample.versions[0] if sample.versions else version

    def pop_episode(self, episode_id: str) -> dict | None:
        """The calls recorded for `episode_id` (prompt ids, completion ids, logprobs,
        policy_version, ...), its reward and restarts, removed; None if unknown."""
        return self.recorder.pop(episode_id) if self.recorder else None

    def update_weights(self, handle: WeightHandle, step: int = -1) -> int:
        """Load `handle`'s weights in place (or, when `handle.meta` carries an
        `adapter_config`, serve base + that adapter) and take its version; returns it.
        With `meta["adapter_name"]` the adapter is held under that name instead (a
        service session's sampler weights, actors/worker_adapters.py): the worker's
        policy_version and the recipe's adapter stay as they were.

        With `meta["verify"]`, every tensor is fingerprinted as it streams in, for the
        controller's proof of delivery (`delivery`, weightsync/verify.py).

        Raises:
            WeightSyncError: fetching or loading failed; names this worker and the
                version. The worker then still reports its old
                version, so the controller sees it is stale.
        """
        name = handle.meta.get("adapter_name")
        # a named adapter leaves the weights in use alone: no generation to interrupt
        gate = self._push_gate() if name is None else nullcontext()
        with gate, self.spans.span("weight_sync", step), self.engine_lock:
            self.debug.check_push(self.worker_id, handle.version)
            time.sleep(self.debug.push_delay_s)
            if name is not None:
                return self._load_named(handle, str(name))
            meta = handle.meta
            adapter = meta.get("adapter_config")
            names = tuple(meta["delta"]["names"]) if "delta" in meta else handle.names
            try:
                if adapter is not None:
                    self._refuse_recipe_adapter()
                stream, tap = self._receive(handle)
                if adapter is not None:
                    loaded = self.engine.load_adapter(stream, adapter, handle.version)
                else:
                    if names:
                        self.engine.validate_names(names)
                    loaded = self.engine.load_weights(stream, version=handle.version)
            except (ValueError, RuntimeError) as e:  # WeightSyncError is a RuntimeError
                raise WeightSyncError(
                    f"rollout worker {self.worker_id}: loading policy_version {handle.version} "
                    f"failed: {e}"
                ) from e
            if tap is not None:
                self.delivered = self._account(handle.version, tap, loaded, adapter is not None)
            if adapter is not None:
                self.adapter_version = handle.version
            self.version = handle.version
        return self.version

    def join_push_group(self, address: str, world_size: int) -> None:
        """Leave the weight broadcast group and join a new one at `address` (a
        `GroupStore`) as rank `worker_id + 1` of `world_size`. Collective: learner rank 0
        and every engine call it at once (the controller re-forms the group after it
        replaced a member; a gloo or NCCL group cannot take a new process).

        Raises:
            WeightSyncError: the group did not form within the transport's timeout.
        """
        self.transport.close()
        self.transport_settings = replace(
            self.transport_settings, group_address=address, group_world=world_size
        )
        self.transport = make_transport(self.transport_settings, rank=self.worker_id + 1)

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
        return {
            "worker": self.worker_id,
            "policy_version": self.version,
            "uptime_s": time.time() - self.started,
            "pid": os.getpid(),
        }

    def drain_spans(self) -> list[Span]:
        return self.spans.drain()

    def close(self) -> None:
        """Release the weight transport's buffers, files and group (and stop the
        OpenAI endpoint)."""
        if self.server is not None:
            self.server.should_exit = True
        self.transport.close()
        self.engine.close()
