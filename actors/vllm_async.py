"""`engine: vllm` with `rollout.vllm.async_engine: true` — vLLM's `AsyncLLM`.

Structure: the engine owns an asyncio loop on a thread of its own, and `AsyncLLM` runs
its engine core in a child process (vLLM 0.32 always does: `AsyncLLM` builds an
`AsyncMPClient`; on Ray it spawns). Every verb is a coroutine run on that loop and waited
for by the calling thread, so `generate` may be called from several threads at once
(the worker's `generate`, the OpenAI endpoint's calls, episode turns): their requests
join one continuously batched stream in the engine core instead of queueing behind a
lock (`concurrent = True`).

Weights: a push is written to a safetensors file in /dev/shm and loaded by the engine
core's worker through the same `reload_weights` as `engine: vllm` (actors/vllm_ext.py;
msgpack does not carry tensors across without their types). The load runs between
`pause_generation(mode="keep", clear_cache=True)` and `resume_generation()`: requests in
flight stay queued (none is dropped), their KV blocks are freed (vLLM preempts every
running request when the cache is reset), so on resume each is prefilled again from its
prompt + the tokens it holds under the new weights, and continues. Before the resume the
engine's weight-version label is set to the pushed policy_version; vLLM tags every output
token with the label in force when it was sampled (`CompletionOutput.weight_versions`),
which `Sample.versions` returns per token: partial rollouts come for free, with each
token's logprob under the version that sampled it.

Concurrency (the order): a push (`load_weights`) pauses → loads → resets the prefix
cache → sets the label → resumes, all on the loop; `generate` calls running meanwhile
wait in the engine core and resume after it. Two pushes are serialised by the worker.

CPU threads: the engine core runs the model in a worker process of its own (vLLM's CPU
platform forces its multiprocessing executor); the two exchange each step through
shared-memory queues, whose readers would spin between steps on the cores the forward
needs. The engine turns that spin off on CPU (actors/vllm_plugin.py).

Seeds: on CPU the step's seed seeds the engine core's global generator before the
requests are added (as `engine: vllm` does in-process); overlapping calls then share that
generator, so only calls that do not overlap repeat their samples. On cuda each request
gets its own seed.

Limits: no LoRA adapters, tensor parallelism or sleep mode (use `async_engine: false`);
each push is copied once into /dev/shm; a continued request is prefilled again after a
push (its old KV is the old policy's).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from .checkpoint_files import checkpoint_params
from .engine import EngineSettings, InferenceEngine, Sample, check_sampling
from .rollout import SamplingSettings
from .vllm_engine import (
    check_pushed_names,
    checked_weights,
    engine_facts,
    output_samples,
    sampling_params,
    vllm_args,
)
from .vllm_plugin import SHM_BUSY_LOOP_ENV

T = TypeVar("T")


def span_versions(spans: list[Any] | None, n_tokens: int, fallback: int) -> list[int]:
    """`[R]` per-token policy versions from vLLM's `weight_versions` spans (`version`
    labels, `[start, end)` token ranges); `[fallback] * n_tokens` when vLLM reported none.

    Raises:
        RuntimeError: the spans do not cover the `n_tokens` tokens exactly.
    """
    if not spans:
        return [fallback] * n_tokens
    out: list[int] = []
    for s in spans:
        if s.start != len(out):
            raise RuntimeError(f"vLLM weight-version spans skip tokens: {spans}")
        out += [int(s.version)] * (s.end - s.start)
    if len(out) != n_tokens:
        raise RuntimeError(f"vLLM weight-version spans cover {len(out)} of {n_tokens} tokens")
    return out


# Parameters from which the engine core's forward outweighs the caller's per-step work
# (measured at two sizes on machine H, docs/benchmarks.md: a 0.3M-parameter model ran
# 2.30x faster with the core at n - 1 threads, SmolLM2-135M 1.2-1.4x faster at n).
CORE_TAKES_ALL_PARAMS = 50_000_000


def core_threads(worker_threads: int, params: int) -> int:
    """OpenMP threads of the engine core on CPU, for a model of `params` parameters.

    The core is a child process; while it runs a step's forward, this process takes
    the previous step's outputs off the socket on its loop thread. For a small model
    that work is a large share of a step: with every core given to the forward it
    preempts one of the core's OpenMP threads and the whole step waits at the next
    barrier, so the core gets one thread fewer than the worker owns (at least one). From
    `CORE_TAKES_ALL_PARAMS` on, the forward is most of a step and the core gets every
    thread the worker owns."""
    if params >= CORE_TAKES_ALL_PARAMS:
        return worker_threads
    return max(1, worker_threads - 1)


class AsyncVLLMEngine(InferenceEngine):
    """Continuous batching across concurrent callers, weights updated in flight.

    Args:
        s: as `VLLMEngine`'s (actors/vllm_engine.py), less LoRA, tensor parallel and sleep.

    Raises:
        RuntimeError: vLLM is not installed.
        ValueError: `lora_rank`, `tensor_parallel_size > 1` or `sleep_between_steps`.
    """

    concurrent = True

    def __init__(self, s: EngineSettings):
        if s.lora_rank is not None or s.tensor_parallel_size != 1 or s.sleep_between_steps:
            raise ValueError(
                "rollout.vllm.async_engine serves no LoRA adapters (weight_sync adapter "
                "mode), no tensor parallelism (gpus_per_engine > 1) and no sleep mode "
                "(colocate on cuda); set rollout.vllm.async_engine: false for those"
            )
        if s.device == "cpu":  # the engine core is a child process: its threads by env
            os.environ["OMP_NUM_THREADS"] = str(
                core_threads(torch.get_num_threads(), checkpoint_params(s.model_path))
            )
            # the core and its worker wait for each other's steps without spinning
            # (actors/vllm_plugin.py, loaded by vLLM in both)
            os.environ[SHM_BUSY_LOOP_ENV] = "0"
        args = vllm_args(s)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = AsyncEngineArgs(**args, disable_log_stats=True)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> Any:  # in the loop, so AsyncLLM starts its output handler
            return AsyncLLM.from_engine_args(engine_args)

        self.llm = self._run(start())
        self.version = 0
        self._run(self.llm.update_weight_version("0"))
        self.tokenizer = self.llm.get_tokenizer()
        model_config = self.llm.model_config
        engine_facts(self, s, model_config.hf_config, model_config.max_model_len)
        self.ids = itertools.count()
        self.inflight: set[str] = set()  # request ids, touched on the loop only
        self.shm = Path(
            tempfile.mkdtemp(
                prefix="posttrain-push-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
            )
        )

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's loop and wait for it (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Sample]]:
        """As every engine's; thread-safe, concurrent calls batched together. Each
        `Sample.versions` holds the policy_version that sampled each token.

        Raises:
            RuntimeError: a weight load failed part-way, or vLLM ended a request
                otherwise than 'stop' or 'length' (aborted by a failed load).
        """
        if self.broken:
            raise RuntimeError(self.broken)
        check_sampling(sampling)
        return self._run(self._generate(prompts, sampling))

    async def _generate(
        self, prompts: list[list[int]], sampling: SamplingSettings
    ) -> list[list[Sample]]:
        from vllm.sampling_params import RequestOutputKind

        if not self.per_request_seed:
            await self.llm.collective_rpc("posttrain_seed", args=(sampling.seed,))
        params = sampling_params(
            sampling,
            len(prompts),
            self.stop_ids,
            self.per_request_seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        return list(
            await asyncio.gather(*(self._one(p, sp) for p, sp in zip(prompts, params, strict=True)))
        )

    async def _one(self, prompt: list[int], params: Any) -> list[Sample]:
        """One prompt's `n` samples, in index order."""
        rid = f"posttrain-{next(self.ids)}"
        self.inflight.add(rid)
        final = None
        try:
            async for out in self.llm.generate({"prompt_token_ids": prompt}, params, rid):
                final = out
        finally:
            self.inflight.discard(rid)
        if final is None:
            raise RuntimeError(f"vLLM request {rid} returned no output")
        return output_samples(
            final,
            rid,
            versions=lambda o, n: span_versions(o.weight_versions, n, self.version),
            why_broken=self.broken,
        )

    def validate_names(self, names: Iterable[str]) -> None:
        check_pushed_names(set(names), self.expected, self.optional)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> list[str]:
        """Load a full push while requests in flight wait (paused, kept); from then on
        their tokens carry `version` (None: the label stays). See the module docstring.

        Raises:
            ValueError: an unknown name, or a parameter left without a new value
                (refused before anything is loaded).
            RuntimeError: the load failed part-way: the requests in flight are aborted
                and the engine refuses to sample again (restart it).
        """
        if self.broken:
            raise RuntimeError(self.broken)
        order: list[str] = []
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in checked_weights(weights, self.expected, self.optional, self.tied):
            t = t.detach().to("cpu").contiguous()
            if t.data_ptr() in seen:  # tied aliases: safetensors stores each storage once
                t = t.clone()
            seen.add(t.data_ptr())
            order.append(name)
            tensors[name] = t
        check_pushed_names(set(order), self.expected, self.optional)
        from safetensors.torch import save_file

        path = self.shm / "push.safetensors"
        save_file(tensors, str(path))
        del tensors
        try:
            names = self._run(self._load(str(path), order, version))
        finally:
            path.unlink(missing_ok=True)
        if version is not None:
            self.version = version
        return names

    async def _load(self, path: str, order: list[str], version: int | None) -> list[str]:
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        try:
            names = (
                await self.llm.collective_rpc(
                    "posttrain_load_weights_file", args=(path, order, self.direct)
                )
            )[0]
            if not await self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight load")
            if version is not None:
                await self.llm.update_weight_version(str(version))
        except Exception as e:  # noqa: BLE001 - any failure leaves layers half loaded
            self.broken = f"a weight load failed part-way ({e}); restart this engine"
            await self.llm.abort(list(self.inflight))
            raise RuntimeError(self.broken) from e
        finally:
            await self.llm.resume_generation()
        return names

    def named_weights(self) -> dict[str, torch.Tensor]:
        """vLLM's own parameters (fused, possibly repacked on CPU); for inspection."""
        from safetensors.torch import load_file

        path = self.shm / "params.safetensors"
        self._run(self.llm.collective_rpc("posttrain_save_parameters", args=(str(path),)))
        try:
            return load_file(str(path))
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the engine core process and the loop; remove the /dev/shm folder."""

        async def stop() -> None:
            if self.llm.output_handler is not None:  # else it logs the core's exit
                self.llm.output_handler.cancel()
            self.llm.shutdown()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        shutil.rmtree(self.shm, ignore_errors=True)
