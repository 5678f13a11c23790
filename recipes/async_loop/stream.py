"""The producer of the asynchronous loop: `RolloutStream` generates and scores ahead
of the learner on its own threads. Its order with pushes, evaluations and checkpoints
is written down in recipes/async_loop/__init__.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import ray

from ...actors.rollout import Rollout
from ...common.telemetry import Span
from ...config import continues_prefixes, continuous_producer, producer_window
from .. import controller as c
from ..algo.dynamic import has_signal
from ..episodes.step import add_environment_rewards, episodes_enabled, requests_for
from ..monitoring.offpolicy import SampleCounts
from ..state import Run
from . import inflight
from .groups import Group, take_fresh


class RolloutStream:
    """Generates and scores ahead of the learner (the order: recipes/async_loop/__init__.py).

    Args:
        run: the running job (recipes/state.py: recipe, roles, prompt stream).
        start_version: the policy_version the engines hold now (the first step).
        produce: start the producer thread; False only in tests that fill `ready`
            themselves to check `take` and the accounting without engines.

    Raises (from `take`): RuntimeError naming the producer's failure (a dead rollout
    worker, a reward service that did not answer).
    """

    def __init__(self, run: Run, start_version: int, produce: bool = True):
        self.run, self.recipe, self.roles = run, run.recipe, run.roles
        self.k = self.recipe.train.max_staleness
        self.episodes = episodes_enabled(self.recipe)
        self.partial = self.recipe.rollout.partial and not self.episodes
        self.token_k = self.recipe.train.max_token_staleness
        # budget: nothing is dropped for staleness; the window alone bounds generation
        self.drop_stale = self.recipe.train.staleness_policy == "drop"
        # one request per group, sent as a slot frees (no rounds)
        self.refill = continuous_producer(self.recipe)
        self.window = producer_window(self.recipe)
        self.dynamic = self.recipe.grpo.dynamic_sampling
        self.per_step = self.recipe.train.prompts_per_step
        self.prompts = run.prompts
        self.cond = threading.Condition()
        self.ready: list[Group] = []
        self.flat: list[Group] = []  # dynamic sampling: groups without signal, not taken yet
        self.flat_since_take = 0  # ... scored since the last `take` (its budget)
        self.outstanding = 0  # groups generating, scoring or ready (not yet taken)
        self.untrained: dict[str, int] = {}  # group id → data position, in draw order
        self.episode_metrics: dict[str, float] = {}  # of the last episode round scored
        self.generating = False
        self.scoring = 0  # shares handed to the scorer and not yet scored
        self.pauses = 0
        self.stopped = False
        self.error: BaseException | None = None
        self.round_ = start_version
        # request key (the worker's index in rounds) → (worker, sent at, round)
        self.inflight: dict[Any, tuple[int, float, int]] = {}
        self.spans: list[Span] = []
        self.counts = SampleCounts()
        # a resume's saved samples by data position, sent with their prompts (inflight.py)
        self.continues = continues_prefixes(self.recipe)
        self.resumed = inflight.on_resume(getattr(run.prompts, "carried", None), self.continues)
        # positions saved finished: `take` waits for them all, to choose as the run did
        self.awaiting = inflight.finished_positions(self.resumed)
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="score")
        self.thread = threading.Thread(target=self._produce, name="rollout-stream", daemon=True)
        if produce:
            self.thread.start()

    # -- producer side --------------------------------------------------------------------
    def _may_start(self, groups: int) -> bool:
        """Whether `groups` more may go out now (lock held)."""
        room = self.outstanding + groups <= self.window
        # dynamic sampling: flat groups give their room back, but at most max_rounds ×
        # prompts_per_step of them per step (the step then trains on what it has)
        budget = self.flat_since_take < self.recipe.grpo.max_rounds * self.per_step
        return self.stopped or (self.pauses == 0 and room and budget)

    def _draw(self) -> tuple[list[Any], int]:
        """The next `prompts_per_step` prompts and their round number, recorded as
        untrained (lock held)."""
        r = self.round_
        self.round_ += 1
        prompts = next(self.prompts)
        for req, at in zip(requests_for(prompts, self.recipe, r), self.prompts.drawn, strict=True):
            self.untrained[req.group_id] = at
        return prompts, r

    def _produce(self) -> None:
        try:
            if self.refill:
                self._produce_refill()
                return
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self._may_start(self.per_step))
                    if self.stopped:
                        return
                    self.generating = True
                    prompts, r = self._draw()
                    self.outstanding += len(prompts)
                if self.episodes:
                    self._episode_round(prompts, r)
                else:
                    self._generate_round(prompts, r)
                with self.cond:
                    self.generating = False
                    self.cond.notify_all()
        except Exception as e:  # noqa: BLE001  (handed to the main thread by `take`)
            self._fail(e)

    def _generate_round(self, prompts: list[Any], round_: int) -> None:
        """One round: every worker's share at once; each share scored as it arrives."""
        chunks, sampling = c.generation_requests(self.roles, prompts, self.recipe, round_)
        with self.cond:
            chunks = {
                i: inflight.attach(q, self.untrained, self.resumed) for i, q in chunks.items()
            }
        refs = {}
        for i, chunk in chunks.items():
            refs[self.roles.rollout[i].generate.remote(chunk, sampling, round_)] = i
            with self.cond:
                self.inflight[i] = (i, time.time(), round_)
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=1.0)
            if self.stopped:
                return
            if not done:
                continue
            i = refs.pop(done[0])
            self._returned(done[0], i, round_)

    def _returned(self, ref: Any, key: Any, round_: int) -> None:
        """Request `key` (in `inflight`) came back: its span, its rollouts to the scorer.

        Raises:
            RuntimeError: its rollout worker died (chained).
        """
        with self.cond:  # drain_spans moves the start of requests in flight
            i, sent, _ = self.inflight.pop(key)
            self.spans.append(Span("rollout", i, "generate", sent, time.time(), round_))
        try:
            rollouts = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(
                f"rollout worker {i} died while generating ahead (train.max_staleness "
                f"{self.k}); the asynchronous loop does not replace engines. Resume from "
                f"the last checkpoint: posttrain run --resume {self.run.run_dir}"
            ) from e
        with self.cond:
            self.scoring += 1
        self.scorer.submit(self._score, rollouts, round_)

    def _produce_refill(self) -> None:
        """Partial rollouts: each group is one request, sent to the worker with the fewest
        in flight as soon as the window has room; a request that comes back is scored at
        once and its slot refilled, so a long sample holds one slot, not a round. A push
        lands in the requests in flight (the workers pause them between tokens)."""
        queue: list[tuple[Any, Any, int]] = []  # (request, sampling, round) drawn, not sent
        refs: dict[Any, int] = {}  # request in flight → its round
        while True:
            with self.cond:
                while not self.stopped and self._may_start(1):
                    if not queue:
                        prompts, r = self._draw()
                        chunks, sampling = c.generation_requests(
                            self.roles, prompts, self.recipe, r
                        )
                        reqs = [q for chunk in chunks.values() for q in chunk]
                        queue += [
                            (q, replace(sampling, seed=(sampling.seed + 7919 * j) % 2**32), r)
                            for j, q in enumerate(reqs)
                        ]
                    req, sampling, r = queue.pop(0)
                    # a resume's saved samples go with it when it is sent (kept till then)
                    (req,) = inflight.attach([req], self.untrained, self.resumed)
                    load = [0] * len(self.roles.rollout)
                    for w, _, _ in self.inflight.values():
                        load[w] += 1
                    w = load.index(min(load))
                    ref = self.roles.rollout[w].generate.remote([req], sampling, r)
                    refs[ref] = r
                    self.inflight[ref] = (w, time.time(), r)
                    self.outstanding += 1
                if self.stopped:
                    return
                self.generating = bool(refs)
                if not refs:
                    self.cond.notify_all()  # an evaluation may wait for the engines to go quiet
                    self.cond.wait(timeout=1.0)
                    continue
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.05)
            for ref in done:
                self._returned(ref, ref, refs.pop(ref))

    def _episode_round(self, prompts: list[Any], round_: int) -> None:
        """One round of multi-turn or agent episodes (recipes/episodes/): every turn of
        every episode under the policy the engines hold (no push lands inside the round),
        then scored with the environment's rewards. Each worker's span is the round's."""
        from ..episodes.step import generate_episodes

        sent = time.time()
        workers = range(
            min(len(self.roles.rollout), len(prompts) * self.recipe.rollout.samples_per_prompt)
        )
        with self.cond:
            for i in workers:
                self.inflight[i] = (i, sent, round_)
        rollouts, metrics = generate_episodes(
            self.roles, prompts, self.recipe, self.run.model_path, round_, self.run.run_dir
        )
        with self.cond:
            for i in workers:
                _, start, _ = self.inflight.pop(i)
                self.spans.append(Span("rollout", i, "generate", start, time.time(), round_))
            self.episode_metrics = metrics
            self.scoring += 1
        self.scorer.submit(self._score, rollouts, round_)

    def _score(self, rollouts: list[Rollout], round_: int) -> None:
        try:
            t0 = time.time()
            scores = c.score(self.roles, rollouts)
            if self.episodes:
                scores = add_environment_rewards(rollouts, scores)
            groups: dict[str, Group] = {}
            for r, s in zip(rollouts, scores, strict=True):
                g = groups.setdefault(r.group_id, Group([], [], round_))
                g.rollouts.append(r)
                g.scores.append(s)
            with self.cond:
                self.spans.append(Span("reward", 0, "score", t0, time.time(), round_))
                for g in groups.values():
                    p = self.untrained.get(g.rollouts[0].group_id)
                    self.awaiting[p] -= self.awaiting[p] > 0
                    if self.dynamic and not has_signal([x.reward for x in g.scores]):
                        self.flat.append(g)  # DAPO: no signal; its room goes back at once
                        self.flat_since_take += 1
                        self.outstanding -= 1
                    else:
                        self.ready.append(g)
                self.counts.generated += len(rollouts)
                self.cond.notify_all()
        except Exception as e:  # noqa: BLE001  (handed to the main thread by `take`)
            self._fail(e)
        finally:
            with self.cond:
                self.scoring -= 1
                self.cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self.cond:
            self.error = e
            self.cond.notify_all()

    # -- learner side ---------------------------------------------------------------------
    def take(self, step: int) -> tuple[list[Group], list[Group], list[Group]]:
        """`prompts_per_step` groups with staleness ≤ k for `step` (waits for them), the
        groups dropped as too old, and (dynamic sampling) the groups without signal
        dropped since the last take.

        With `grpo.dynamic_sampling`, only groups with signal fill the batch; once
        `grpo.max_rounds × prompts_per_step` groups were scored for the step without
        filling it, it trains on the groups with signal it has, or on a batch of flat
        ones when it has none (zero advantages), as the synchronous sampler does.

        Raises:
            RuntimeError: the producer or a scoring call failed (chained).
        """
        dropped: list[Group] = []
        with self.cond:
            while True:
                if self.error is not None:
                    raise RuntimeError(
                        f"generating rollouts ahead failed: {self.error}"
                    ) from self.error
                if any(n > 0 for n in self.awaiting.values()):
                    self.cond.wait()
                    continue
                fresh, stale, rest = take_fresh(
                    self.ready, step, self.k, self.per_step, self.token_k, self.drop_stale
                )
                if stale:  # never trained on; their room goes back to the producer
                    dropped += stale
                    self.ready = fresh + rest
                    self._consumed(stale)
                    self.counts.dropped += sum(len(g.rollouts) for g in stale)
                batch = fresh if len(fresh) == self.per_step else self._short_batch(fresh, step)
                if batch is not None:
                    return batch, dropped, self._taken(batch)
                self.cond.wait()

    def _short_batch(self, fresh: list[Group], step: int) -> list[Group] | None:
        """Dynamic sampling with its step budget spent: the groups with signal, else
        fresh flat ones; None while the budget lasts (lock held)."""
        if not self.dynamic:
            return None
        if len(fresh) + self.flat_since_take < self.recipe.grpo.max_rounds * self.per_step:
            return None
        flat = take_fresh(self.flat, step, self.k, self.per_step, self.token_k, self.drop_stale)
        return fresh or flat[0] or None

    def _taken(self, batch: list[Group]) -> list[Group]:
        """Move `batch` out of the stream as trained, drop every other flat group (lock
        held); returns the flat groups dropped."""
        used = {id(g) for g in batch}
        self.ready = [g for g in self.ready if id(g) not in used]
        self.outstanding += sum(id(g) in used for g in self.flat)  # their room went back
        flat = [g for g in self.flat if id(g) not in used]
        self.flat, self.flat_since_take = [], 0
        self._consumed(batch)
        self.counts.trained += sum(len(g.rollouts) for g in batch)
        for g in flat:
            self.untrained.pop(g.rollouts[0].group_id, None)
        self.counts.dropped += sum(len(g.rollouts) for g in flat)
        self.counts.flat += sum(len(g.rollouts) for g in flat)
        return flat

    def _consumed(self, groups: list[Group]) -> None:
        """Count `groups` as out of the stream (lock held): room for the producer, and
        their prompts no longer untrained."""
        self.outstanding -= len(groups)
        for g in groups:
            self.untrained.pop(g.rollouts[0].group_id, None)
        self.cond.notify_all()

    def sample_counts(self) -> SampleCounts:
        """A consistent copy of the running sample totals."""
        with self.cond:
            return replace(self.counts)

    def data_state(self, prefixes: bool = False) -> dict[str, Any] | None:
        """The prompt stream's position with the prompts drawn but neither trained on nor
        dropped (generating, scoring or ready) as its `pending` (what a checkpoint saves:
        a resume generates them first, so each prompt trains once). With `prefixes`
        (a checkpoint), also their samples so far (`inflight.checkpoint_state`), which a
        resume continues."""
        if prefixes:
            return inflight.checkpoint_state(self)
        with self.cond:
            return self.prompts.state(list(self.untrained.values()))

    @contextmanager
    def paused(self, scoring: bool = False, push: bool = False) -> Iterator[None]:
        """No generation round runs inside: waits for the one in flight to end (a weight
        push lands between generation requests). With `scoring`, also waits until every
        share handed to the scorer is scored (an evaluation scores on the same reward
        client). With `push` under partial rollouts, only new rounds wait: the round in
        flight takes the push between tokens."""
        in_flight_ok = push and self.partial and not scoring

        def quiet() -> bool:
            busy = (self.generating and not in_flight_ok) or (scoring and self.scoring > 0)
            return not busy or self.error is not None

        with self.cond:
            self.pauses += 1
            self.cond.wait_for(quiet)
        try:
            yield
        finally:
            with self.cond:
                self.pauses -= 1
                self.cond.notify_all()

    def drain_spans(self, now: float) -> list[Span]:
        """Finished generate/score spans since the last call, plus the part up to `now`
        of each request still running (its start moves to `now` for the next call)."""
        with self.cond:
            spans, self.spans = self.spans, []
            for key, (i, sent, r) in list(self.inflight.items()):
                spans.append(Span("rollout", i, "generate", sent, now, r))
                self.inflight[key] = (i, now, r)
        return spans

    def close(self) -> None:
        """Stop the producer (a round in flight is abandoned) and the scorer."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.thread.ident is not None:  # started
            self.thread.join(timeout=5.0)
        self.scorer.shutdown(wait=False, cancel_futures=True)
