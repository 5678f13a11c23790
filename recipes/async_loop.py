"""Asynchronous GRPO/PPO steps (`train.max_staleness: k ≥ 1`): rollouts for the next k
steps are generated and scored while the learner trains, with bounded staleness.

Structure:

- `RolloutStream` runs one producer thread on the controller. It takes
  `train.prompts_per_step` prompts at a time, sends each rollout worker its share
  (`generate`, one Ray call per worker) and, as each worker's share comes back, hands
  it to a scoring thread; every scored group (the samples of one prompt) goes to a
  ready list. The learner's batch is filled from finished groups in the order they
  finished (streaming: a slow engine does not hold the others' groups back).
  With partial rollouts (`rollout.partial`) on an engine that takes concurrent calls
  (`continuous_producer`: vLLM's AsyncLLM, which batches them continuously, or the 'hf'
  engine) there are no rounds: each group is its own request, sent to the worker with
  the fewest in flight as soon as the window has room and scored as soon as it
  returns, so a long sample holds one slot, not a round. vLLM's synchronous LLM keeps
  rounds (one batched call per engine).
  Multi-turn episodes and agents (`rollout.max_turns`, `rollout.agent`): a round is a
  batch of episodes (recipes/episodes/step.py), scored with the environment's rewards.
  Dynamic sampling (`grpo.dynamic_sampling`): a group whose rewards are all equal is
  set aside (its room goes back at once) and dropped at the next `take`, unless the
  step's budget of `grpo.max_rounds × prompts_per_step` scored groups runs out first
  (the step then trains on what it has, as recipes/algo/dynamic.py does).
- `async_step` is one step: take `prompts_per_step` fresh groups, write them to
  `rollouts/step_NNNNN.jsonl` (each sample with its `policy_version`), train, and push
  the new policy.

Staleness. A sample made by policy_version v trains at step s only if s − v ≤ k. The
producer keeps at most k × prompts_per_step groups generating, scoring or waiting (the
window, `producer_window`), which by itself bounds s − v by k; any group found older at
`take` (a slow tail, a resume) is dropped and counted in `dropped_stale`, never used.
With partial rollouts a sample's v is its oldest token's. `rollout.oversample` widens
the window (APRIL's over-sampling, Zhou et al. 2025: the first groups to finish fill a
step, the long ones finish later under newer weights), and `train.max_token_staleness`
m ≥ k then decides which of those train: a group is fresh at step s when
s − (its newest token's version) ≤ k and s − (its oldest token's) ≤ m.

Concurrency (the order, written down):
1. The producer starts a generation round only when no push is waiting and the window
   holds a round more; the round's Ray calls all go out at once and the round ends when
   every engine has answered. With partial rollouts it sends one group at a time on the
   same conditions, and "generating" means any request in flight.
2. A push (`paused()`) first stops new rounds and waits for the round in flight to end,
   so a push lands between generation requests: an engine never mixes two policy
   versions inside one sample. With partial rollouts (`rollout.partial`) it stops new
   rounds only: the push reaches the engines while they generate, each pauses between
   tokens, loads and resumes (actors/partial.py), and its samples record the version
   of every token; a group's staleness counts from its oldest token.
3. An evaluation (`eval:`) pauses the same way and also waits for the scorer to go
   idle, so it samples exactly the policy version it names and scores on the reward
   client alone.
4. Only the main thread trains, pushes, evaluates and checkpoints; the producer only
   generates and scores. A dead rollout worker stops the run (resume from the last checkpoint)
   rather than being replaced under a concurrent push.

Checkpoints and resume (each prompt trains once): the data position saved carries, as
`pending`, the data positions of every prompt drawn and neither trained on nor dropped
(generating, scoring or ready); a resume, or a learner restart (recipes/recovery.py,
which closes this stream), generates those first under the checkpoint's policy, then
continues from the position. Groups ready but unused when the run stops are discarded.

Telemetry: the controller sees when each engine's request went out and came back;
those intervals (and the in-flight part of a request still running at the end of a
step) are the rollout side's `generate` spans, so idle fractions stay right while both
sides run at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import ray

from ..actors.rollout import Rollout
from ..common.telemetry import Span
from ..config import continuous_producer, producer_window
from ..rewards.protocol import Score
from . import controller as c
from .algo.dynamic import has_signal
from .algo.grpo import apply_failure_policy, rollout_batch, rollout_metrics
from .empty_steps import train_or_skip
from .episodes.step import add_environment_rewards, episodes_enabled, requests_for
from .monitoring.offpolicy import SampleCounts, offpolicy_metrics


@dataclass
class Group:
    """The scored samples of one prompt, from generation round `round_`."""

    rollouts: list[Rollout]
    scores: list[Score]
    round_: int

    @property
    def version(self) -> int:
        """The oldest policy_version among its samples' tokens (all equal without partial
        rollouts)."""
        return min(r.policy_version for r in self.rollouts)

    @property
    def newest(self) -> int:
        """The newest policy_version among its samples' tokens (the version that finished
        the group; `version` without partial rollouts)."""
        return max(max(r.policy_versions or [r.policy_version]) for r in self.rollouts)


def take_fresh(
    groups: list[Group], step: int, k: int, count: int, token_k: int | None = None
) -> tuple[list[Group], list[Group], list[Group]]:
    """Split ready `groups` (in the order they finished) for training step `step`: up to
    `count` within bounds, those too old (dropped), and the rest (kept for later steps).

    A group is within bounds when `step − newest ≤ k` and `step − version ≤ token_k`
    (its oldest token; `token_k` None: `k`, i.e. staleness counts from the oldest token).
    Of those, the `count` closest to going stale are taken (earliest deadline
    `min(newest + k, version + token_k)` first; ties in the order given), so a group
    left waiting is not dropped while younger ones train. Pure; each list keeps the
    order of `groups`."""
    token_k = k if token_k is None else token_k
    stale, within = [], []
    for g in groups:
        (stale if step - g.newest > k or step - g.version > token_k else within).append(g)
    by_deadline = sorted(within, key=lambda g: min(g.newest + k, g.version + token_k))
    chosen = {id(g) for g in by_deadline[:count]}
    fresh = [g for g in within if id(g) in chosen]
    rest = [g for g in within if id(g) not in chosen]
    return fresh, stale, rest


class RolloutStream:
    """Generates and scores ahead of the learner (see the module docstring).

    Args:
        run: the `recipes.loop.Run` (recipe, roles, prompt stream).
        start_version: the policy_version the engines hold now (the first step).

    Raises (from `take`): RuntimeError naming the producer's failure (a dead rollout
    worker, a reward service that did not answer).
    """

    def __init__(self, run: Any, start_version: int):
        self.run, self.recipe, self.roles = run, run.recipe, run.roles
        self.k = self.recipe.train.max_staleness
        self.episodes = episodes_enabled(self.recipe)
        self.partial = self.recipe.rollout.partial and not self.episodes
        self.token_k = self.recipe.train.max_token_staleness
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
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="score")
        self.thread = threading.Thread(target=self._produce, name="rollout-stream", daemon=True)
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
        from .episodes.step import generate_episodes

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
                fresh, stale, rest = take_fresh(
                    self.ready, step, self.k, self.per_step, self.token_k
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
        return fresh or take_fresh(self.flat, step, self.k, self.per_step, self.token_k)[0] or None

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

    def data_state(self) -> dict[str, Any] | None:
        """The prompt stream's position with the prompts drawn but neither trained on nor
        dropped (generating, scoring or ready) as its `pending` (what a checkpoint saves:
        a resume generates them first, so each prompt trains once)."""
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
        self.thread.join(timeout=5.0)
        self.scorer.shutdown(wait=False, cancel_futures=True)


class StreamPosition:
    """Stands in for the run's prompt stream once the producer owns it: `state()` is the
    position a checkpoint must save (`RolloutStream.data_state`)."""

    def __init__(self, stream: RolloutStream):
        self.stream = stream

    def state(self) -> dict[str, Any] | None:
        return self.stream.data_state()


def async_step(run: Any, algo: Any, step: int) -> tuple[dict[str, float], list[Span]]:
    """One step of the asynchronous loop: take fresh groups → save → train → push (with
    the producer paused). Metrics as `rl_step`'s, plus the off-policy accounting of
    recipes/monitoring/offpolicy.py (`staleness_mean`, `staleness_max`, `staleness_frac/{d}`,
    versions spanned per sample, sample counts that add up), `dropped_stale`
    (samples), `time/wait_rollouts` (the learner
    waiting for fresh groups) and `time/wait_push` (waiting for a round in flight).
    `time/generate` is the wait for fresh groups and `time/score` 0: generation and
    scoring overlap training, only the wait is on the step's critical path."""
    recipe, roles = run.recipe, run.roles
    if run.stream is None:
        run.stream = RolloutStream(run, start_version=step)
        run.prompts = StreamPosition(run.stream)
    t0 = time.time()
    groups, stale, flat = run.stream.take(step)
    counts = run.stream.sample_counts()
    t1 = time.time()
    rollouts = [r for g in groups for r in g.rollouts]
    scores = [s for g in groups for s in g.scores]
    if recipe.monitor.save_rollouts:
        c.save_rollouts(run.run_dir, step, rollouts, scores)
    rewards = apply_failure_policy(scores, rollouts, recipe.on_reward_failure)
    batch = rollout_batch(rollouts, rewards, roles.pad_id)
    stats = train_or_skip(algo, roles.learners, batch, rollouts, rewards, scores, step)
    t_trained = time.time()
    accuracy_of = next((r.name for r in recipe.rewards if r.type == "math"), None)
    quality = rollout_metrics(rollouts, scores, accuracy_of)
    trained = {"policy_version": step + 1, **quality, **stats}  # the line of a failed push
    with run.stream.paused(push=True):
        t_push = time.time()
        sync_s = c.push_after_training(roles, recipe, step + 1, trained)
    t_end = time.time()
    telemetry, spans = _telemetry(run, t0, t_end)
    dropped = sum(len(g.rollouts) for g in stale)
    bound = max(run.stream.k, run.stream.token_k or 0)
    accounting = offpolicy_metrics(
        rollouts, step, bound, counts, dropped + sum(len(g.rollouts) for g in flat)
    )
    tokens = sum(len(r.response_ids) for r in rollouts)
    return {
        "policy_version": step + 1,
        "rollout_restarts": roles.counters.rollout_restarts,
        "reward_restarts": roles.counters.reward_restarts,
        **quality,
        **stats,
        **accounting,
        "dropped_stale": float(dropped),
        **_sampler_metrics(run.stream, flat),
        "time/wait_rollouts": t1 - t0,
        "time/wait_push": t_push - t_trained,
        # the step's critical path: generation and scoring run behind training
        "time/generate": t1 - t0,
        "time/score": 0.0,
        "time/weight_sync": sync_s,
        "time/step": t_end - t0,
        "weight_sync_bytes": roles.counters.last_push_bytes,
        "weight_sync_changed_fraction": roles.counters.last_push_changed,
        "rollout_tokens_per_s": tokens / (t_end - t0),
        "weight_sync_fraction": sync_s / (t_end - t0),
        **telemetry,
    }, spans


def _sampler_metrics(stream: RolloutStream, flat: list[Group]) -> dict[str, float]:
    """Dynamic sampling's dropped groups (no signal) at this step; the episode metrics
    of the last episode round scored."""
    out = dict(stream.episode_metrics)
    if stream.dynamic:
        out["dynamic/dropped_groups"] = float(len(flat))
    return out


def _telemetry(run: Any, start: float, end: float) -> tuple[dict[str, float], list[Span]]:
    """Idle fractions and busy seconds of both sides in [start, end], from the workers'
    own spans and the controller's view of each generation request."""
    return c.step_telemetry(run.roles, start, end, [], counted=run.stream.drain_spans(end))
