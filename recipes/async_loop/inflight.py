"""What a checkpoint of the asynchronous loop keeps of the samples not trained yet, and
how a resume continues them (each prompt trains once, no sampled token is lost).

At a checkpoint (`RolloutStream.data_state(prefixes=True)`) every rollout worker hands
over the samples it has in flight (`RolloutWorker.inflight_prefixes`: token ids,
`inference_logprobs`, per-token policy versions, done or not), and the groups generated
but not trained yet (ready, or set aside without signal) come as finished samples. The
data position's `prefixes` maps each prompt's position to those rows; a prompt drawn
but neither in flight on a worker that can hand it over nor finished (queued, being
scored, or on vLLM's AsyncLLM) has none and is generated again, counted in
`regenerated`. On `--resume` the producer sends each pending prompt with its row
(`PromptRequest.prefixes`): the worker continues every unfinished sample from prompt +
prefix with the budget left, so the prefix's tokens, logprobs and versions are the
killed run's by construction (actors/worker_inflight.py).

A `kill -9` leaves no chance to read the engines: what survives is what was in flight
at the last checkpoint (the checkpoint after every step when `train.checkpoint_every`
is 1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import ray

from ...actors.rollout import PromptRequest
from .groups import Group

#: why a prompt in flight has no saved prefix, for the resume's console line
WHY_ASYNC = (
    "the engines keep their requests' tokens out of reach (vLLM's AsyncLLM, or no rollout.partial)"
)


def read_workers(
    workers: list[Any], timeout_s: float = 60.0
) -> tuple[dict[str, list[dict[str, Any]]], bool]:
    """Every worker's samples in flight, `{group_id: [n × sample dict]}`, and whether a
    worker could not hand its own over: no push gate (None), dead (the checkpoint of a
    run stopping because an engine died) or silent for `timeout_s`; the checkpoint is
    written either way, those prompts are generated again."""
    refs = [w.inflight_prefixes.remote() for w in workers]
    rows: dict[str, list[dict[str, Any]]] = {}
    cannot = False
    for ref in refs:
        try:
            one = ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            one = None
        rows.update(one or {})
        cannot = cannot or one is None
    return rows, cannot


def finished_rows(groups: Iterable[Group]) -> dict[str, list[dict[str, Any]]]:
    """Generated groups as rows of finished samples, `{group_id: [n × sample dict]}`
    (their order within the group is the sample index)."""
    out = {}
    for g in groups:
        rollouts = sorted(g.rollouts, key=lambda r: int(r.uid.rsplit("-", 1)[1]))
        out[rollouts[0].group_id] = [
            {
                "token_ids": list(r.response_ids),
                "logprobs": list(r.inference_logprobs),
                "versions": list(r.policy_versions or [r.policy_version] * len(r.response_ids)),
                "finish_reason": r.finish_reason,
                "done": True,
            }
            for r in rollouts
        ]
    return out


def checkpoint_state(stream: Any) -> dict[str, Any]:
    """What a checkpoint saves of a `RolloutStream`'s data: its prompt stream's position
    with the untrained prompts as `pending`, plus `saved_state` of their samples: read
    from the engines with no new request going out (when they can hand them over,
    `continues_prefixes`), and the groups generated whole (ready or without signal)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    cannot = True
    if stream.continues:
        with stream.paused(push=True):
            rows, cannot = read_workers(stream.roles.rollout)
    with stream.cond:
        if stream.continues:  # single-turn samples a resume can hand back
            rows.update(finished_rows([*stream.ready, *stream.flat]))
        carried = saved_state(stream.untrained, rows, stream.resumed, cannot)
        return {**stream.prompts.state(list(stream.untrained.values())), **carried}


def finished_positions(saved: Mapping[int, list[list[dict[str, Any]]]]) -> Counter:
    """How many saved rows of each position are finished (every sample done): groups the
    stopped run had generated whole, which a resume scores without generating. The
    first `take` waits for all of them (`RolloutStream.awaiting`), so that it chooses
    among them by deadline as the stopped run would have; else one scored later could
    be dropped as stale under `staleness_policy: drop`."""
    return Counter(p for p, rows in saved.items() for r in rows if all(s["done"] for s in r))


def saved_state(
    untrained: Mapping[str, int],
    rows: Mapping[str, list[dict[str, Any]]],
    carried: Mapping[int, list[list[dict[str, Any]]]],
    engines_cannot: bool,
) -> dict[str, Any]:
    """The data position's additions: `prefixes` `{str(position): [row, ...]}` for the
    untrained prompts (group id → position) that have a row, plus the rows a resume
    has not sent yet (`carried`, still pending); `regenerated`: how many untrained
    prompts have none, and why when an engine could not hand them over."""
    prefixes: dict[str, list[list[dict[str, Any]]]] = {
        str(p): [list(r) for r in rs] for p, rs in carried.items() if rs
    }
    missing = 0
    for gid, position in untrained.items():
        if gid in rows:
            prefixes.setdefault(str(position), []).append(rows[gid])
        elif not carried.get(position):  # a carried row not sent yet stays in `carried`
            missing += 1
    why = WHY_ASYNC if engines_cannot else "not begun or being scored at the checkpoint"
    return {"prefixes": prefixes, "regenerated": {"prompts": missing, "why": why}}


def loaded(state: Mapping[str, Any] | None) -> dict[int, list[list[dict[str, Any]]]]:
    """A checkpoint's `prefixes` by data position (empty for a checkpoint without)."""
    saved = (state or {}).get("prefixes") or {}
    return {int(p): [list(r) for r in rows] for p, rows in saved.items()}


def attach(
    requests: list[PromptRequest],
    untrained: Mapping[str, int],
    saved: dict[int, list[list[dict[str, Any]]]],
) -> list[PromptRequest]:
    """`requests` with the saved row of their prompt's position, each row used once
    (popped from `saved`)."""
    out = []
    for req in requests:
        rows = saved.get(untrained.get(req.group_id, -1))
        if rows:
            out.append(replace(req, prefixes=rows.pop(0)))
        else:
            out.append(req)
    return out


def on_resume(
    carried: Mapping[str, Any] | None, can: bool
) -> dict[int, list[list[dict[str, Any]]]]:
    """A resume's saved rows by data position, once its console line is printed;
    empty when this run's engines cannot continue them (`can` False: generated again)."""
    saved = loaded(carried)
    if line := resume_line(saved, carried, can):
        print(line, flush=True)
    return saved if can else {}


def resume_line(
    saved: Mapping[int, list[list[dict[str, Any]]]], state: Mapping[str, Any] | None, can: bool
) -> str | None:
    """The console line of a resume with saved samples (None without any): how many
    prompts continue, how many tokens they keep, how many are generated again and why."""
    rows = [r for rs in saved.values() for r in rs]
    regen = ((state or {}).get("regenerated") or {}).get("prompts", 0)
    if not rows and not regen:
        return None
    tokens = sum(len(s["token_ids"]) for r in rows for s in r)
    if not can:
        return (
            f"resume: {len(rows) + regen} prompts in flight at the checkpoint are generated "
            f"again ({len(rows)} had saved samples, {tokens} tokens): this run's engines "
            "cannot continue a prefix (vLLM's AsyncLLM, or no rollout.partial)"
        )
    why = (state or {})["regenerated"]["why"] if regen else ""
    again = f"; {regen} generated again ({why})" if regen else ""
    return (
        f"resume: {len(rows)} prompts continue from the samples saved at the checkpoint "
        f"({tokens} tokens kept){again}"
    )
