"""`CallBatcher`: the OpenAI endpoint's calls on an engine that takes one call at a
time (vLLM's `LLM`, the HF engine), sampled together.

Why: a black-box agent's episodes (`rollout.agent`, a verifiers v1 driver) each make
their own calls, so N episodes at once are N one-prompt calls. Run one after another,
a 135M model on 2 CPU cores decodes one sequence at ~33 ms a token: 8 calls of 16
tokens took 4.2 s where one engine call of the same 8 prompts took 0.85 s
(docs/benchmarks.md).

How (no batching window, no wait of its own): a call queues its prompt, then waits
for the engine. The first caller to get it takes every call queued by then and runs
them as one `generate` per set of equal sampling settings (the seed aside); the calls
it took return their own sample, the rest wait for the next turn. A lone call is
sampled alone, as before; calls arriving while the engine is busy go together next.

Seeds: an engine call has one seed, so calls sampled together use the first call's
(its `request_seed(seed, i)` per prompt where the engine has per-request seeds). A call
then samples the same again only when it is sampled alone; what is recorded is what
was sampled either way, token for token.

Errors: when a batch of several calls raises, each call is retried alone, so an error
reaches only the call that causes it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .engine import Sample
from .rollout import SamplingSettings

#: (prompts `[N][P_i]`, sampling with n = 1) -> (`[N]` samples, policy_version)
RunBatch = Callable[[list[list[int]], SamplingSettings], tuple[list[Sample], int]]


@dataclass
class _Call:
    ids: list[int]
    sampling: SamplingSettings
    result: tuple[Sample, int] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class CallBatcher:
    """Thread-safe: `generate` may be called from any number of threads at once.

    Args:
        run: samples a batch (the caller of `run` holds whatever engine lock it needs
            inside it); given calls of one sampling setting (n = 1) at a time.
    """

    def __init__(self, run: RunBatch) -> None:
        self._run = run
        self._queue_lock = threading.Lock()  # guards `_queue`
        self._turn = threading.Lock()  # one batch on the engine at a time
        self._queue: list[_Call] = []
        # calls per engine call, the latest 4096 in order (tests, benches)
        self.batches: deque[int] = deque(maxlen=4096)

    def waiting(self) -> int:
        """Calls queued and not yet taken by a batch."""
        with self._queue_lock:
            return len(self._queue)

    def generate(self, ids: list[int], sampling: SamplingSettings) -> tuple[Sample, int]:
        """Sample one completion of `ids` (`sampling.n` must be 1): (the sample, the
        policy_version that sampled it).

        Raises:
            ValueError: `sampling.n` is not 1.
            Exception: whatever the engine raised for this call.
        """
        if sampling.n != 1:
            raise ValueError(f"one sample per call (n = 1), got n = {sampling.n}")
        call = _Call(ids, sampling)
        with self._queue_lock:
            self._queue.append(call)
        with self._turn:
            if not call.done.is_set():  # not taken by the previous batch: take the queue
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                self._serve(batch)
        if call.error is not None:
            raise call.error
        assert call.result is not None  # noqa: S101 - _serve sets result or error
        return call.result

    def _serve(self, batch: list[_Call]) -> None:
        """Sample `batch`, one engine call per sampling setting (seed aside)."""
        groups: dict[SamplingSettings, list[_Call]] = {}
        for c in batch:
            groups.setdefault(replace(c.sampling, seed=0), []).append(c)
        try:
            for calls in groups.values():
                self._sample(calls)
        except BaseException as e:  # e.g. KeyboardInterrupt: no call waits forever
            for c in batch:
                if c.result is None and c.error is None:
                    c.error = e
            raise
        finally:
            for c in batch:
                c.done.set()

    def _sample(self, calls: list[_Call]) -> None:
        """One engine call for `calls` (same settings); alone each when it raises."""
        self.batches.append(len(calls))
        try:
            samples, version = self._run([c.ids for c in calls], calls[0].sampling)
        except Exception as e:  # noqa: BLE001 - handed to the calls that caused it
            if len(calls) == 1:
                calls[0].error = e
            else:
                for c in calls:
                    self._sample([c])
            return
        for c, s in zip(calls, samples, strict=True):
            c.result = (s, version)
