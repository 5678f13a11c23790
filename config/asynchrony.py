"""Rules of `train.max_staleness` and `train.correction` that span recipe blocks, checked
by the recipe's model validator (pydantic only, no torch)."""

from __future__ import annotations

from typing import Any


def check_async_and_correction(recipe: Any) -> None:
    """Refuse combinations the asynchronous loop or the correction cannot honour.

    Raises:
        ValueError: names the keys and what to set instead.
    """
    t = recipe.train
    if t.correction.mode != "none" and recipe.algorithm == "dpo":
        raise ValueError(
            "train.correction corrects sampled rollouts, and DPO samples none; "
            "remove train.correction or use algorithm grpo or ppo"
        )
    if t.correction.mode != "none" and recipe.rollout.top_p < 1.0:
        # The engines disagree on what they report under top-p (vLLM's processed
        # logprobs are renormalised over the nucleus, transformers' are not), so a weight
        # against the learner's full-softmax logprobs would be biased either way.
        raise ValueError(
            f"rollout.top_p is {recipe.rollout.top_p} and train.correction.mode is "
            f"{t.correction.mode!r}: the importance weight needs the learner's logprob under "
            "the same truncated, renormalised distribution the engine sampled from, which "
            "the learner does not compute; set rollout.top_p: 1.0, or "
            "train.correction.mode: none"
        )
    if t.max_staleness == 0:
        return
    key = f"train.max_staleness is {t.max_staleness}"
    if recipe.algorithm == "dpo":
        raise ValueError(
            f"{key}, but DPO has no rollouts to generate ahead; set train.max_staleness: 0"
        )
    if recipe.grpo.dynamic_sampling:
        raise ValueError(
            f"{key} and grpo.dynamic_sampling is on; the asynchronous loop "
            "fills batches from finished groups without DAPO's extra rounds; set "
            "one of them off (train.max_staleness: 0 or grpo.dynamic_sampling: "
            "false)"
        )
    if recipe.rollout.max_turns > 1 or recipe.rollout.agent is not None:
        raise ValueError(
            f"{key} and rollout episodes are multi-turn (rollout.max_turns / rollout.agent); "
            "episodes run in the synchronous loop only for now; set train.max_staleness: 0"
        )
    if t.max_restarts > 0:
        raise ValueError(
            f"{key} and train.max_restarts is {t.max_restarts}: a learner-group restart "
            "rewinds the data stream, which the asynchronous producer is reading ahead of; "
            "set train.max_restarts: 0 (a dead learner then stops the run naming the "
            "checkpoint to resume from) or train.max_staleness: 0"
        )
