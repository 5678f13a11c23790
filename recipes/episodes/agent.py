"""Black-box agent episodes: the calls a rollout worker's OpenAI-compatible endpoint
recorded for one episode (actors/openai_server.py) → one token-exact `Rollout`.

Each call's prompt ids extend the previous call's prompt + completion ids (the endpoint
builds them so); the trajectory is the first call's prompt, then per call the new
environment ids (`loss_mask` 0: tool results, user turns, the template's closing) and
the sampled completion (`loss_mask` 1, with its `inference_logprobs`). When the agent
rewrote its history, a call does not extend the previous one: the trajectory is the
last unbroken chain of calls (the earlier calls are counted in `dropped_calls`).
"""

from __future__ import annotations

from typing import Any

from ...actors.rollout import Rollout
from ...rewards.protocol import is_finite_number


class AgentEpisodeError(ValueError):
    """An episode has no recorded call (the agent never called the endpoint with it)."""


def agent_rollout(
    uid: str,
    group_id: str,
    record: dict[str, Any] | None,
    decode,
    ground_truth: str = "",
    metadata: dict[str, Any] | None = None,
) -> Rollout:
    """The episode's `Rollout` (see the module docstring).

    Args:
        record: `RolloutWorker.pop_episode(uid)`: `calls`, `reward`, `components`,
            `reward_error`, `restarts`.
        decode: ids → text (the policy's tokenizer, special tokens skipped).

    Returns:
        A Rollout with `loss_mask`, `turns`, `policy_version` the oldest of its calls,
        `finish_reason` of the last call, and the agent's reward (when it gave one) in
        `metadata['environment_reward']` (added to the reward components' sum), plus
        `metadata['dropped_calls']`. A reward the endpoint refused as not finite (the
        record's `reward_error`) goes to `metadata['episode_error']`: the sample's
        score then fails (recipes/episodes/step.py `add_environment_rewards`).

    Raises:
        AgentEpisodeError: no call was recorded under `uid`.
    """
    calls = _recorded_calls(uid, record)
    start = _last_chain_start(calls)
    chain = calls[start:]
    prompt = chain[0]["prompt_ids"]
    ids, mask, logprobs, turns = _chain_tokens(chain, len(prompt), decode)
    meta = _episode_metadata(uid, record, metadata, start)
    return Rollout(
        uid=uid,
        group_id=group_id,
        prompt_ids=prompt,
        response_ids=ids,
        inference_logprobs=logprobs,
        finish_reason=chain[-1]["finish_reason"],
        policy_version=min(c["policy_version"] for c in chain),
        prompt_text=decode(prompt),
        response_text=turns[-1]["text"],
        ground_truth=ground_truth,
        metadata=meta,
        loss_mask=mask,
        turns=turns,
    )


def _recorded_calls(uid: str, record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The record's calls; raises `AgentEpisodeError` when there is none."""
    calls = (record or {}).get("calls") or []
    if not calls:
        raise AgentEpisodeError(
            f"episode {uid!r}: the agent made no call with this episode id "
            "(X-Episode-Id header or episode_id field)"
        )
    return calls


def _last_chain_start(calls: list[dict[str, Any]]) -> int:
    """Index of the first call of the last unbroken chain: each call's prompt ids
    extend the previous call's prompt + completion ids (0 when no call broke it)."""
    start = 0
    for k in range(1, len(calls)):
        prev = calls[k - 1]
        if calls[k]["prompt_ids"][: len(prev["prompt_ids"]) + len(prev["completion_ids"])] != (
            prev["prompt_ids"] + prev["completion_ids"]
        ):
            start = k
    return start


def _turn(role: str, ids: list[int], logprobs, policy_version, decode) -> dict[str, Any]:
    """One entry of `Rollout.turns`: environment ids (mask 0) or a completion (mask 1)."""
    return {
        "role": role,
        "ids": ids,
        "mask": 1 if role == "assistant" else 0,
        "logprobs": logprobs,
        "policy_version": policy_version,
        "text": decode(ids),
    }


def _chain_tokens(chain: list[dict[str, Any]], seen: int, decode) -> tuple[list, list, list, list]:
    """The chain's response: per call its new environment ids (mask 0, logprob 0.0)
    then its completion (mask 1, the engine's logprobs).

    Args:
        seen: length of the first call's prompt (the part that is the Rollout's prompt).

    Returns:
        `(response_ids, loss_mask, inference_logprobs, turns)`, the first three `[T]`.
    """
    ids, mask, logprobs, turns = [], [], [], []
    for c in chain:
        env = c["prompt_ids"][seen:]
        if env:
            ids += env
            mask += [0] * len(env)
            logprobs += [0.0] * len(env)
            turns.append(_turn("environment", env, None, None, decode))
        comp = c["completion_ids"]
        ids += comp
        mask += [1] * len(comp)
        logprobs += c["logprobs"]
        turns.append(_turn("assistant", comp, c["logprobs"], c["policy_version"], decode))
        seen = len(c["prompt_ids"]) + len(comp)
    return ids, mask, logprobs, turns


def _episode_metadata(
    uid: str, record: dict[str, Any], metadata: dict[str, Any] | None, dropped: int
) -> dict[str, Any]:
    """`metadata` plus `dropped_calls`, and the agent's reward as `environment_reward`
    (its parts as `environment_components`) or, when the endpoint refused it or it is
    not finite, an `episode_error`."""
    meta = dict(metadata or {}) | {"dropped_calls": dropped}
    reward = record.get("reward")
    if record.get("reward_error"):
        meta["episode_error"] = record["reward_error"]
    elif reward is not None and not is_finite_number(reward):
        meta["episode_error"] = f"agent reward for episode {uid} is {reward!r}, not finite"
    elif reward is not None:
        meta["environment_reward"] = float(reward)
        if record.get("components"):  # each a reward component (step.py)
            meta["environment_components"] = dict(record["components"])
    return meta
