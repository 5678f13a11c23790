"""Rules of `train.max_staleness` and `train.correction` that span recipe blocks, checked
by the recipe's model validator (pydantic only, no torch)."""

from __future__ import annotations

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
