"""`posttrain eval`: a saved model scored on a recipe's held-out set, with the code the
runs use.

- A policy of a GRPO / PPO recipe (`sample_eval`): sampled on the recipe's rollout
  engine (or another) and scored by its rewards through `evaluation.sample_and_score`,
  the in-training evaluation itself, on a one-off set of rollout workers and reward
  service: pass@1, pass@k, mean reward, mean response length.
- A reward model (`reward_model_eval`): pairwise accuracy on held-out pairs, the pairs
  rendered as training renders them (`pair_tokens.render_pairs`), scored as the learner
  scores them (`common.score_head.sequence_scores`).
- A DPO policy (`dpo_eval`): implicit-reward accuracy β·[(π_c − ref_c) − (π_r − ref_r)]
  > 0 and the mean margin, on held-out pairs, against the reference (the recipe's
  `model.path`), with the learner's logprobs (`learner.logprobs.sequence_logprobs`); and
  (`win_rate`) how often the policy's sample beats the reference's under a reward model.

Ties count half a win everywhere (the reference scored against itself gives 0.5). Each
result keeps its per-item values (a prompt's pass@1, a pair's 0 / 0.5 / 1), so
`bootstrap_ci` gives a 95% interval over prompts or pairs (bench/learning.py).

Limits: the pair evaluations run in this process on the CPU, batch by batch, in the
recipe's `model.dtype`; a pair's rows are truncated as in training (`max_length`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...common.numbers import finite32
from ...config import Recipe, RecipeError
from ..data.pair_tokens import render_pairs
from ..data.pairs import PreferencePair


@dataclass
class EvalResult:
    """One evaluation.

    Attributes:
        metric: the headline metric's name (a key of `metrics`).
        metrics: every number, by name.
        items: the headline metric per prompt or pair, in order (its mean is the metric).
        prompt_rewards: a sampling evaluation's mean reward per prompt text.
    """

    metric: str
    metrics: dict[str, float]
    items: list[float] = field(default_factory=list)
    prompt_rewards: dict[str, float] = field(default_factory=dict)


def bootstrap_ci(
    values: Sequence[float], reps: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (Efron & Tibshirani 1993,
    ch. 13): `reps` resamples with replacement, seeded.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    rng, n = random.Random(seed), len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(reps))
    lo = int((1 - level) / 2 * reps)
    return means[lo], means[min(reps - 1, reps - 1 - lo)]


def _dtype(recipe: Recipe) -> Any:
    """The recipe's compute dtype (`model.dtype`), as the learner computes in it."""
    import torch

    return torch.bfloat16 if recipe.model.dtype == "bfloat16" else torch.float32


def _wins(a: float, b: float) -> float:
    return 1.0 if a > b else 0.5 if a == b else 0.0


def _batches(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def reward_model_eval(
    model_dir: str | Path,
    pairs: list[PreferencePair],
    recipe: Recipe,
    batch_pairs: int = 8,
    fresh_head_seed: int | None = None,
) -> EvalResult:
    """Pairwise accuracy of a reward model on `pairs`: `accuracy` (chosen scored above
    rejected; ties half), `margin` (mean chosen − rejected score), `pairs`.

    Args:
        model_dir: a sequence-classification folder (RUN_DIR/final of a reward model),
            or with `fresh_head_seed` a causal LM given a new seeded one-label head (the
            untrained reward model, a baseline).
        recipe: its `reward_model.max_length` and `chat_template` render the pairs.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ...algorithms.batch import pack_rows
    from ...common.score_head import sequence_scores

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = recipe.reward_model
    done = render_pairs(pairs, tok, cfg.max_length, cfg.chat_template)
    if fresh_head_seed is not None:
        torch.manual_seed(fresh_head_seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1, dtype=_dtype(recipe)
    ).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    items, margins = [], []
    with torch.no_grad():
        for rows in _batches(len(done.pairs), batch_pairs):
            ps = [done.pairs[i] for i in rows]
            packed = [(p.prompt_ids, r) for p in ps for r in (p.chosen_ids, p.rejected_ids)]
            ids, attn, _, _ = pack_rows(packed, pad)
            s = sequence_scores(model, ids, attn).tolist()
            for c, r in zip(s[0::2], s[1::2], strict=True):
                items.append(_wins(c, r))
                margins.append(c - r)
    return EvalResult(
        "accuracy",
        {
            "accuracy": statistics.fmean(items),
            "margin": statistics.fmean(margins),
            "pairs": float(len(items)),
        },
        items,
    )


def _reply_sums(model: Any, done: Any, pad: int, batch_pairs: int) -> list[float]:
    """Summed logprob of every pair's chosen and rejected reply (chosen, rejected, ...)."""
    import torch

    from ...learner.logprobs import sequence_logprobs
    from ..algo.dpo import pair_batch

    out: list[float] = []
    with torch.no_grad():
        for rows in _batches(len(done.pairs), batch_pairs):
            b = pair_batch([done.pairs[i] for i in rows], pad)
            lp = sequence_logprobs(
                model,
                b.input_ids,
                b.attention_mask,
                b.response_start,
                wanted=b.response_mask,  # the LM head on the replies' tokens only
            )
            out += (lp * b.response_mask).sum(-1).tolist()
    return out


def dpo_eval(
    policy_dir: str | Path,
    reference_dir: str | Path,
    pairs: list[PreferencePair],
    recipe: Recipe,
    batch_pairs: int = 4,
) -> EvalResult:
    """Implicit-reward accuracy of a DPO policy on `pairs` (Rafailov et al. 2023, §5):
    r = β·(log π(y|x) − log π_ref(y|x)) summed over the reply; `accuracy` (r_chosen >
    r_rejected, ties half), `margin` (mean r_chosen − r_rejected), `chosen`, `rejected`
    (mean rewards), `policy_preference` (how often the policy alone gives the chosen
    reply the higher summed logprob, ties half), `pairs`. Pairs rendered as DPO
    renders them (`dpo.max_length`, `dpo.chat_template`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    d = recipe.dpo
    done = render_pairs(pairs, tok, d.max_length, d.chat_template)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    sums = []
    for folder in (policy_dir, reference_dir):
        if sums and Path(folder).resolve() == Path(policy_dir).resolve():
            sums.append(sums[0])  # the base against itself: the same sums
            continue
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(recipe)).eval()
        sums.append(_reply_sums(model, done, pad, batch_pairs))
        del model
    pol, ref = sums
    rc = [d.beta * (p - r) for p, r in zip(pol[0::2], ref[0::2], strict=True)]
    rr = [d.beta * (p - r) for p, r in zip(pol[1::2], ref[1::2], strict=True)]
    items = [_wins(c, r) for c, r in zip(rc, rr, strict=True)]
    return EvalResult(
        "accuracy",
        {
            "accuracy": statistics.fmean(items),
            "margin": statistics.fmean(c - r for c, r in zip(rc, rr, strict=True)),
            "chosen": statistics.fmean(rc),
            "rejected": statistics.fmean(rr),
            "policy_preference": statistics.fmean(
                _wins(c, r) for c, r in zip(pol[0::2], pol[1::2], strict=True)
            ),
            "pairs": float(len(items)),
        },
        items,
    )


def sample_eval(recipe: Recipe, model_dir: str | Path, out_dir: Path) -> EvalResult:
    """Sample `recipe.eval.k` responses per held-out prompt from `model_dir` on the
    recipe's rollout engine, score them with its rewards (`evaluation.sample_and_score`,
    the in-training evaluation), write them to `out_dir/eval/step_00000.jsonl`:
    `pass@1`, `pass@k`, `reward_mean` (avg@k), `length_mean` (response tokens),
    `prompts`, `k`; items are each prompt's pass@1.

    Raises:
        RecipeError: the recipe has no `eval:` block (no held-out prompts), or a role
            failed to start.
    """
    from ..data import load_eval_prompts

    if recipe.eval is None:
        raise RecipeError(
            f"recipe {recipe.name}: no eval: block, so no held-out prompts; give "
            "--prompts FILE (a file of prompts in any layout data.train reads)"
        )
    prompts = load_eval_prompts(recipe)
    metrics, rollouts, scores = _sample_on_roles(recipe, str(model_dir), prompts, out_dir)
    result = _sample_result(metrics, rollouts, scores, recipe.eval.pass_threshold)
    if recipe.rewards and all(c.type == "reward_model" for c in recipe.rewards):
        return _rm_score_result(result, rollouts, scores, recipe.rewards[0].name)
    return result


def _rm_score_result(
    result: EvalResult, rollouts: list[Any], scores: list[Any], name: str
) -> EvalResult:
    """A policy scored by a reward model alone: the headline is the model's raw score
    (`NAME.raw` in the details when the service normalises, else the reward), whose
    normalised value means nothing across evaluations (running statistics) and whose
    pass@1 means nothing at all. Adds `rm_score` (mean over samples), `rm_score_std`
    (their population std, the yardstick of a change) and `rm_scored` (samples with a
    finite score); items are each prompt's mean raw score (a failed score is left out,
    a prompt with none counts 0.0)."""
    groups: dict[str, list[float]] = {}
    for r, s in zip(rollouts, scores, strict=True):
        raw = s.details.get(f"{name}.raw", s.reward)
        groups.setdefault(r.group_id, [])
        if finite32(raw):
            groups[r.group_id].append(float(raw))
    every = [v for vals in groups.values() for v in vals]
    items = [statistics.fmean(v) if v else 0.0 for v in groups.values()]
    metrics = dict(result.metrics)
    metrics.update(
        rm_score=statistics.fmean(every) if every else math.nan,
        rm_score_std=statistics.pstdev(every) if every else math.nan,
        rm_scored=float(len(every)),
    )
    return EvalResult("rm_score", metrics, items, result.prompt_rewards)


def _sample_result(
    metrics: dict[str, Any], rollouts: list[Any], scores: list[Any], threshold: float
) -> EvalResult:
    """The headline numbers of `sample_and_score`, with each prompt's pass@1."""
    from ..evaluation import pass_at_k

    groups: dict[str, list[Any]] = {}
    texts: dict[str, str] = {}
    for r, s in zip(rollouts, scores, strict=True):
        groups.setdefault(r.group_id, []).append(s.reward)
        texts[r.group_id] = r.prompt_text
    items = [
        pass_at_k(len(v), sum(x is not None and x >= threshold for x in v), 1)
        for v in groups.values()
    ]
    names = {
        "pass@1": "eval/pass@1",
        "pass@k": "eval/pass@k",
        "reward_mean": "eval/avg@k",
        "length_mean": "eval/length_mean",
        "prompts": "eval/prompts",
        "k": "eval/k",
    }
    # episodes: tool calls, turns (recipes/evaluation.py `sample_and_score`)
    names |= {k.removeprefix("eval/"): k for k in metrics if k.startswith("eval/episode/")}
    by_prompt = {
        texts[g]: statistics.fmean(0.0 if x is None else x for x in v) for g, v in groups.items()
    }
    return EvalResult("pass@1", {k: float(metrics[v]) for k, v in names.items()}, items, by_prompt)


def _sample_on_roles(
    recipe: Recipe, model_dir: str, prompts: list[Any], out_dir: Path
) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """Start rollout workers on `model_dir` and the recipe's rewards, run
    `evaluation.sample_and_score` once (policy version 0), stop them all."""
    import ray

    from ...common.process import default_threads
    from ..evaluation import sample_and_score
    from ..placement import place
    from ..roles import (
        Roles,
        init_ray,
        rollout_spec,
        start_environment_server,
        start_rewards,
        start_rollout,
        stop_roles,
        transport_settings,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    started = not ray.is_initialized()
    if started:
        init_ray(recipe, None, rollout=True)
    roles = Roles(learners=[], placement=place(recipe.resources, rollout=True))
    try:
        start_environment_server(roles, recipe, out_dir)
        roles.reward, launch = start_rewards(recipe, out_dir)
        roles.reward_proc = launch.start() if launch else None
        threads = recipe.resources.threads_per_worker or default_threads(
            len(roles.placement.rollout)
        )
        spec = rollout_spec(recipe, model_dir, threads, transport_settings(recipe, out_dir))
        roles.rollout = start_rollout(spec, roles.placement)
        ray.get([w.health.remote() for w in roles.rollout])
        if roles.reward is not None and roles.reward.local is not None:
            roles.reward.local.wait_ready(timeout_s=120, proc=roles.reward_proc)
        return sample_and_score(roles, recipe, prompts, out_dir, 0, model_dir)
    finally:
        stop_roles(roles)
        if started:
            ray.shutdown()
