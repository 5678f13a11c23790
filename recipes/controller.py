"""The controller's named calls a step is made of (`generate`, `score`, `on_learners`,
`push_weights`, telemetry, the rollout files), with the recovery from a dead rollout
worker or reward service; starting and stopping the roles is recipes/roles/ (its names
are re-exported here). The loop itself is recipes/loop.py; what an algorithm does with a
step is recipes/algo/base.py.

Each step's rollouts and scores are written to disk before training on them, so a
crash loses no scored sample.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from ..actors.rollout import PromptRequest, Rollout, SamplingSettings
from ..algorithms.batch import TrainBatch
from ..common.telemetry import Span, busy_seconds, generation_tail, idle_fraction
from ..config import Recipe
from ..rewards.protocol import Score, ScoreItem
from ..weightsync import (
    DeliveryError,
    WeightSyncError,
    push,
)
from .data.items import PromptItem, chat_messages
from .roles import (  # noqa: F401  (re-exported: the loop calls c.<name>)
    LocalServiceLaunch,
    Roles,
    RolloutSpec,
    adapter_sync,
    init_ray,
    reform_push_group,
    rollout_spec,
    start_learners,
    start_rewards,
    start_roles,
    start_rollout,
    start_rollout_worker,
    stop_roles,
    transport_settings,
    write_manifest,
)

if TYPE_CHECKING:
    pass


def generate(
    roles: Roles,
    prompts: list[PromptItem],
    recipe: Recipe,
    step: int,
    round_: int = 0,
    sampling: SamplingSettings | None = None,
    tag: str = "s",
) -> list[Rollout]:
    """Sample a group per prompt, spreading prompts over the rollout workers. `round_`
    (dynamic sampling's extra rounds of a step) gives distinct group ids and seeds;
    `sampling` defaults to the recipe's rollout settings (evaluation passes its own), `tag`
    starts every group id (`s` for training, `e` for evaluation)."""
    chunks, sampling = generation_requests(roles, prompts, recipe, step, round_, sampling, tag)
    return generate_surviving(roles, recipe, chunks, sampling, step)


def generation_requests(
    roles: Roles,
    prompts: list[PromptItem],
    recipe: Recipe,
    step: int,
    round_: int = 0,
    sampling: SamplingSettings | None = None,
    tag: str = "s",
) -> tuple[dict[int, list[PromptRequest]], SamplingSettings]:
    """What `generate` sends: rollout worker i's requests `chunks[i]` and the sampling
    settings (arguments as `generate`)."""
    messages = [chat_messages(p, recipe.model.system_prompt) for p in prompts]
    requests = [
        PromptRequest(
            f"{tag}{step}{f'r{round_}' if round_ else ''}-p{p.prompt_id}-{i}",
            m,
            p.ground_truth,
            p.metadata,
        )
        for i, (p, m) in enumerate(zip(prompts, messages, strict=True))
    ]
    sampling = sampling or SamplingSettings(
        n=recipe.rollout.samples_per_prompt,
        max_new_tokens=recipe.rollout.max_new_tokens,
        temperature=recipe.rollout.temperature,
        top_p=recipe.rollout.top_p,
        seed=recipe.train.seed * 100_003 + step + 1_000_003 * round_,
        stop=tuple(recipe.rollout.stop),
    )
    n = len(roles.rollout)
    return {i: requests[i::n] for i in range(n) if requests[i::n]}, sampling


def generate_surviving(
    roles: Roles,
    recipe: Recipe,
    chunks: dict[int, list[PromptRequest]],
    sampling: SamplingSettings,
    step: int,
) -> list[Rollout]:
    """Worker i generates `chunks[i]`; the Rollouts in worker order.

    Recovers from a rollout worker that dies during `generate` (killed, out of memory,
    crashed: Ray's `RayActorError`): it is replaced on its placement bundle
    (`replace_rollout_worker`) and only its chunk is generated again, so each prompt's
    group appears exactly once. A worker that dies twice in one step stops the run.
    """
    done: dict[int, list[Rollout]] = {}
    for attempt in range(2):
        futures = {
            i: roles.rollout[i].generate.remote(c, sampling, step)
            for i, c in chunks.items()
            if i not in done
        }
        lost = []
        for i, f in futures.items():
            try:
                done[i] = ray.get(f)
            except ray.exceptions.RayActorError as e:
                if attempt == 1:
                    raise RuntimeError(
                        f"rollout worker {i} died again in step {step} after a restart: {e}"
                    ) from e
                lost.append(i)
        for i in lost:
            replace_rollout_worker(roles, recipe, i)
    return [r for i in sorted(done) for r in done[i]]


def replace_rollout_worker(roles: Roles, recipe: Recipe, index: int) -> None:
    """Start rollout worker `index` again on its placement bundle and give it the policy
    every other engine holds, as the same `policy_version` (the learners publish it
    again). Counted in `roles.counters.rollout_restarts`.

    Recovers from a dead rollout worker process. With `weight_sync.type: collective` the
    broadcast group is formed anew (`reform_push_group`: learner rank 0, every engine,
    a new rendezvous store) and the policy is broadcast to every engine again (the
    others take the version they already hold); with the other transports only the new
    engine receives it.

    Raises:
        WeightSyncError: the new group did not form, or the new engine did not take the
            policy.
    """
    spec = roles.specs.rollout
    if spec is None:
        raise RuntimeError(f"rollout worker {index} died and this run cannot start one")
    grouped = roles.group is not None
    if grouped:  # the new engine joins the new group below, not the dead one
        spec = replace(spec, transport=replace(spec.transport, group_address=None))
    try:
        ray.kill(roles.rollout[index], no_restart=True)
    except ray.exceptions.RayError:
        pass
    print(
        f"rollout worker {index} died; starting a replacement at policy_version "
        f"{roles.counters.policy_version}",
        flush=True,
    )
    worker = start_rollout_worker(spec, index, roles.placement.rollout[index])
    ray.get(worker.health.remote())
    roles.rollout[index] = worker
    if grouped:
        reform_push_group(roles, recipe)
    targets = roles.rollout if grouped else [worker]
    qlora = adapter_sync(recipe) and recipe.model.adapter.type == "qlora"
    if qlora:  # its base must be the learner's dequantised NF4 base, as at start
        push(roles.learners, targets, 0, recipe.weight_sync.timeout_s, full=True, fresh=True)
    if roles.counters.policy_version > 0 or grouped:  # whole tensors: the new engine has no base
        push(
            roles.learners,
            targets,
            roles.counters.policy_version,
            recipe.weight_sync.timeout_s,
            fresh=True,
        )
    roles.counters.rollout_restarts += 1


def score(roles: Roles, rollouts: list[Rollout]) -> list[Score]:
    """One `Score` per rollout, in order (`reward` None when scoring failed). A dead
    local reward service is restarted and its lost items scored again
    (`restart_reward_service`)."""
    items = [
        ScoreItem(
            uid=r.uid,
            prompt=r.prompt_text,
            response=r.response_text,
            ground_truth=r.ground_truth,
            metadata=r.metadata,
            messages=r.messages or None,
        )
        for r in rollouts
    ]
    scores = roles.reward.score(items)
    if roles.reward_proc is None or roles.reward_proc.poll() is None:
        return scores
    restart_reward_service(roles)
    again = [i for i, s in zip(items, scores, strict=True) if s.reward is None]
    rescored = {s.uid: s for s in roles.reward.score(again)}
    return [rescored.get(s.uid, s) for s in scores]


def restart_reward_service(roles: Roles) -> None:
    """Start the local reward service again on its port and token and wait until it
    answers; counted in `roles.counters.reward_restarts`.

    Recovers from a local reward service that died (killed, crashed, out of memory)
    before or during a request: `score` then scores again exactly the items that got no
    score, so no sample is scored twice into the batch or left at a silent 0 (an
    item failing again keeps `reward: None` and goes to `on_reward_failure`).

    Raises:
        RuntimeError: the service did not come back within 120 s.
    """
    code = roles.reward_proc.returncode
    print(f"reward service exited (code {code}); restarting it", flush=True)
    roles.reward_proc = roles.specs.reward.start()
    roles.reward.local.wait_ready(timeout_s=120, proc=roles.reward_proc)
    roles.counters.reward_restarts += 1


def on_learners(learners: list[Any], method: str, batch: TrainBatch, *args: Any) -> list[Any]:
    """Call `method(shard_r, *args)` on every learner rank at once (a collective) and
    return each rank's result; `len(batch)` must split evenly over the ranks."""
    world = len(learners)
    return ray.get(
        [getattr(lw, method).remote(batch.shard(r, world), *args) for r, lw in enumerate(learners)]
    )


def push_weights(roles: Roles, recipe: Recipe, version: int) -> float:
    """Publish the new policy and wait for every engine to hold `version`; seconds.

    Recovers from one failed or timed-out push: an engine that did not take it keeps
    serving its old version (`update_weights` takes a version only once loaded), and the
    whole push is tried once more.

    Raises:
        WeightSyncError: the second try failed too; names the engine, the version and
            what each engine still serves.
    """
    t0 = time.time()
    for attempt in (1, 2):
        try:
            # the retry is a full push: a failed delta may have left engines part-updated
            handle = push(
                roles.learners,
                roles.rollout,
                version,
                recipe.weight_sync.timeout_s,
                fresh=attempt == 2,
            )
            break
        except DeliveryError:  # corrupted weights: stop, never hide it behind a retry
            raise
        except WeightSyncError as e:
            if attempt == 2:
                raise WeightSyncError(
                    f"weight push failed twice: {e}; engines still serve "
                    f"policy_versions {served_versions(roles)}"
                ) from e
            print(
                f"weight push of policy_version {version} failed ({e}); trying once more",
                flush=True,
            )
    roles.counters.last_push_bytes = handle.num_bytes
    roles.counters.last_push_changed = handle.meta.get("changed_fraction", 1.0)
    roles.counters.policy_version = version
    return time.time() - t0


class StepPushFailed(WeightSyncError):
    """A step trained, then its weight push failed twice (`push_after_training`);
    `metrics`: what the step measured up to the push, written as its line before the run
    stops (the checkpoint that follows holds the step's training)."""

    def __init__(self, error: WeightSyncError, metrics: dict[str, Any]):
        super().__init__(str(error))
        self.metrics = metrics


def push_after_training(roles: Roles, recipe: Recipe, version: int, trained: dict) -> float:
    """`push_weights` after a training step; seconds.

    Raises:
        StepPushFailed: the push failed twice; carries `trained`, the step's metrics so
            far, so the loop still writes the step's metrics line.
    """
    try:
        return push_weights(roles, recipe, version)
    except WeightSyncError as e:
        raise StepPushFailed(e, trained) from e


def served_versions(roles: Roles, timeout_s: float = 10.0) -> list[int | None]:
    """The policy_version each engine holds (None: dead, or no answer within
    `timeout_s`)."""
    refs = [w.policy_version.remote() for w in roles.rollout]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return [_answer(r) if r in ready else None for r in refs]


def _answer(ref: Any) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError:  # a dead engine serves nothing
        return None


def step_telemetry(
    roles: Roles, start: float, end: float, extra: list[Span], counted: list[Span] | None = None
) -> tuple[dict[str, float], list[Span]]:
    """Idle fractions, busy seconds and generation tail of one step from every worker's
    spans plus `counted` (the asynchronous loop's view of each generation request), with
    the controller's own `extra` spans appended uncounted; returns metrics and all spans."""
    spans: list[Span] = [
        s
        for part in ray.get([a.drain_spans.remote() for a in roles.rollout + roles.learners])
        for s in part
    ]
    spans += counted or []
    n_r, n_l = len(roles.rollout), len(roles.learners)
    return {
        "rollout_idle_fraction": idle_fraction(spans, "rollout", n_r, start, end),
        "learner_idle_fraction": idle_fraction(spans, "learner", n_l, start, end),
        "rollout_busy_s": busy_seconds(spans, "rollout", n_r, start, end),
        "learner_busy_s": busy_seconds(spans, "learner", n_l, start, end),
        "time/generation_tail": generation_tail(spans),
    }, spans + extra


def save_rollouts(
    run_dir: Path,
    step: int,
    rollouts: list[Rollout],
    scores: list[Score],
    folder_name: str = "rollouts",
) -> None:
    """One jsonl per step in `run_dir/folder_name`: every rollout with its reward (and the
    scoring error in `reward_details.error`), written before training on it."""
    folder = run_dir / folder_name
    folder.mkdir(exist_ok=True)
    with open(folder / f"step_{step:05d}.jsonl", "w") as f:
        for r, s in zip(rollouts, scores, strict=True):
            details = s.details | ({"error": s.error} if s.error else {})
            f.write(
                json.dumps(r.to_dict() | {"reward": s.reward, "reward_details": details}) + "\n"
            )
