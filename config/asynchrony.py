"""Rules of `train.max_staleness` and `train.correction` that span recipe blocks, checked
by the recipe's model validator (pydantic only, no torch)."""

from __future__ import annotations

import math
from typing import Any


def check_async_and_correction(recipe: Any) -> None:
    """Refuse combinations the asynchronous loop or the correction cannot honour.

    Raises:
        ValueError: names the keys and what to set instead.
    """
    # train.correction.mode's default under staleness is set by `stale_correction`.
    t = recipe.train
    key = f"train.max_staleness is {t.max_staleness}"
    facts = recipe.facts
    data = {"pairs": "preference pairs", "chat": "conversations"}.get(facts.data)
    if t.max_staleness and data:
        raise ValueError(
            f"{key}, but algorithm {recipe.algorithm} trains on {data} and has no rollouts "
            "to generate ahead; set train.max_staleness: 0"
        )
    if t.correction.mode != "none" and data:
        raise ValueError(
            f"train.correction corrects sampled rollouts, and algorithm {recipe.algorithm} "
            "samples none; remove train.correction or use algorithm grpo or ppo"
        )
    _check_partial_window(recipe)
    _check_decoupled(recipe)
    _check_budget(recipe)
    if t.correction.mode != "none" and recipe.rollout.top_p < 1.0:
        # The engines disagree on what they report under top-p (vLLM's processed
        # logprobs are renormalised over the nucleus, transformers' are not), so a weight
        # against the learner's full-softmax logprobs would be biased either way.
        default = " (its default with train.max_staleness ≥ 1)" if t.max_staleness else ""
        raise ValueError(
            f"rollout.top_p is {recipe.rollout.top_p} and train.correction.mode is "
            f"{t.correction.mode!r}{default}: the importance weight needs the learner's "
            "logprob under the same truncated, renormalised distribution the engine sampled "
            "from, which the learner does not compute; set rollout.top_p: 1.0, or "
            "train.correction.mode: none (stale samples then train uncorrected)"
        )


def continuous_producer(recipe: Any) -> bool:
    """Whether the asynchronous producer sends each group as its own request as a slot
    frees (recipes/async_loop/) instead of a round at a time: partial rollouts,
    single-turn, on an engine that batches concurrent calls and pauses them for a push
    (vLLM's AsyncLLM; the 'hf' engine, segment by segment). vLLM's synchronous LLM runs
    one call at a time, so it keeps rounds (one batched call per engine)."""
    r, t = recipe.rollout, recipe.train
    concurrent = r.engine == "hf" or r.vllm.async_engine
    return r.partial and t.max_staleness >= 1 and not r.episodic and concurrent


def continues_prefixes(recipe: Any) -> bool:
    """Whether the rollout workers can hand a checkpoint the samples they have in flight
    and continue them on `--resume` (actors/worker_inflight.py): partial rollouts,
    single-turn, on an engine that samples in segments under the push gate ('hf',
    vLLM's synchronous LLM). vLLM's AsyncLLM keeps its requests' tokens inside the
    engine: a resume generates those prompts again."""
    r, t = recipe.rollout, recipe.train
    segments = r.engine == "hf" or not r.vllm.async_engine
    return r.partial and t.max_staleness >= 1 and not r.episodic and segments


def producer_window(recipe: Any) -> int:
    """Groups the asynchronous producer keeps generating, scoring or waiting at most:
    k × prompts_per_step, times `rollout.oversample` (rounded up) when it sends groups
    one by one (`continuous_producer`; k = `train.max_staleness`, 0 at k = 0)."""
    window = recipe.train.max_staleness * recipe.train.prompts_per_step
    if continuous_producer(recipe):
        window = math.ceil(window * recipe.rollout.oversample)
    return window


def _check_partial_window(recipe: Any) -> None:
    """`rollout.oversample` and `train.max_token_staleness` act only on the producer that
    sends groups one by one (`continuous_producer`); elsewhere they would be silently
    ignored.

    Raises:
        ValueError: names the key and what to set.
    """
    t, r = recipe.train, recipe.rollout
    partial = continuous_producer(recipe)
    need = (
        "rollout.partial: true, train.max_staleness >= 1, single-turn rollouts "
        "(rollout.max_turns 1, no rollout.agent) and an engine that takes requests "
        "concurrently (rollout.engine: hf, or vllm with rollout.vllm.async_engine: true)"
    )
    if r.oversample > 1.0 and not partial:
        raise ValueError(
            f"rollout.oversample is {r.oversample}, which over-samples the partial-rollout "
            f"producer only; it needs {need}, or set rollout.oversample: 1.0"
        )
    m = t.max_token_staleness
    if m is None:
        return
    if m < t.max_staleness:
        raise ValueError(
            f"train.max_token_staleness is {m}, below train.max_staleness "
            f"{t.max_staleness}: a sample's oldest token is never newer than its newest; "
            f"set it to at least {t.max_staleness}, or null"
        )
    if m > t.max_staleness and not partial:
        raise ValueError(
            f"train.max_token_staleness is {m}: only samples continued across weight "
            f"pushes (partial rollouts) span versions; it needs {need}, or set it to null"
        )
    if m > t.max_staleness and t.correction.mode == "none":
        raise ValueError(
            f"train.max_token_staleness {m} trains tokens up to {m} versions old, and "
            "train.correction.mode is none: they would train with the on-policy gradient; "
            "set train.correction.mode: tis (or mis, or decoupled)"
        )


def _check_budget(recipe: Any) -> None:
    """`train.staleness_policy: budget` bounds generation instead of dropping: it needs
    k >= 1, leaves no drop rule to set, and trains samples that may be older than k, so
    they must be weighed.

    Raises:
        ValueError: names the key and what to set.
    """
    t = recipe.train
    if t.staleness_policy != "budget":
        return
    if t.max_staleness < 1:
        raise ValueError(
            "train.staleness_policy is budget, which bounds how far generation runs ahead "
            "of training, and train.max_staleness is 0 (synchronous: nothing runs ahead); "
            "set train.max_staleness >= 1, or train.staleness_policy: drop"
        )
    if t.max_token_staleness is not None:
        raise ValueError(
            f"train.max_token_staleness is {t.max_token_staleness}, a rule for dropping "
            "samples, and train.staleness_policy is budget, which drops none; set "
            "train.max_token_staleness: null, or train.staleness_policy: drop"
        )
    if t.correction.mode == "none":
        raise ValueError(
            "train.staleness_policy is budget, which trains a sample continued across pushes "
            "or kept waiting when it is more than train.max_staleness versions old, and "
            "train.correction.mode is none: it would train with the on-policy gradient; set "
            "train.correction.mode: decoupled (or tis, mis)"
        )


def _check_decoupled(recipe: Any) -> None:
    """`train.correction.mode: decoupled` needs a per-token weight and a trust region
    around the proximal policy (algorithms/correction.py).

    Raises:
        ValueError: names the key and what to set.
    """
    c = recipe.train.correction
    if c.mode != "decoupled":
        return
    if c.level != "token":
        raise ValueError(
            f"train.correction.mode is decoupled and train.correction.level is {c.level}: "
            "decoupled PPO weighs each token by the policy that sampled it (with partial "
            "rollouts, tokens of one response come from several versions); set "
            "train.correction.level: token, or mode tis or mis for a sequence weight"
        )
    if recipe.algorithm == "grpo" and recipe.grpo.loss == "cispo":
        raise ValueError(
            "train.correction.mode is decoupled and grpo.loss is cispo: decoupled PPO clips "
            "pi_theta/pi_prox as a trust region around the proximal policy, and CISPO has no "
            "such clip (it clips a detached weight); set grpo.loss: ppo_clip (or gspo), or "
            "train.correction.mode: tis"
        )


def stale_correction(train: Any) -> Any:
    """`train:` (its raw mapping, before validation) with `correction.mode: tis` when
    `max_staleness` ≥ 1 and no mode is given: a sample from an older policy otherwise
    trains with the on-policy gradient (no importance weight between the policy that
    sampled and the one trained from). An explicit mode, `none` included, is kept.
    Anything that is not a mapping is left to the schema's own checks."""
    if not isinstance(train, dict):
        return train
    try:
        stale = int(train.get("max_staleness") or 0)
    except (TypeError, ValueError):
        return train  # the field's own validation reports it
    corr = train.get("correction")
    if stale < 1:
        return train
    if corr is None:
        return {**train, "correction": {"mode": "tis"}}
    if isinstance(corr, dict) and "mode" not in corr:
        return {**train, "correction": {**corr, "mode": "tis"}}
    if hasattr(corr, "model_fields_set") and "mode" not in corr.model_fields_set:
        return {**train, "correction": corr.model_copy(update={"mode": "tis"})}
    return train
