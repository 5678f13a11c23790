"""What `posttrain eval TARGET` does between its options and its output: resolve the
target (recipes/assess/targets.py), load the recipe with the command line's overrides,
pick the evaluation the target and recipe call for (recipes/assess/scoring.py), and
return one JSON-able report.

Which evaluation: a reward model (a score-head target, or any target with a
`reward_model` recipe) → pairwise accuracy on `data.heldout`; a `dpo` recipe →
implicit-reward accuracy and margin on `data.heldout` against the recipe's base model
(an adapter, a run's final/ included, merged into that float32 base first, not its
merged/ folder: a QLoRA run builds that on the NF4-dequantised base), and with
`reward_model_dir` the win rate of the policy's samples over the base's;
otherwise → pass@1 / pass@k / mean reward / mean length on `eval:`'s prompts.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import TypeAdapter, ValidationError

from ...common.model_registry import resolve_model_path
from ...config import Recipe, RecipeError, default_facts
from ...config.rewards import RewardSpec
from ...config.rollout import RolloutConfig
from ...config.yamlfile import read_yaml
from ..loading import format_errors, load_recipe
from .scoring import EvalResult, dpo_eval, reward_model_eval, sample_eval
from .targets import Target, materialize, resolve_target


def _overrides(
    tree: dict[str, Any],
    engine: str | None,
    rewards: Path | None,
    prompts: Path | None,
    k: int | None,
) -> list[str]:
    """`--set` strings for the command line's options on the recipe `tree` (raw YAML)."""
    out = []
    if engine:
        engines = get_args(RolloutConfig.model_fields["engine"].annotation)
        if engine not in engines:  # else the error would name the recipe's rollout.engine
            raise RecipeError(f"--engine {engine}: not an engine; use one of {', '.join(engines)}")
        out.append(f"rollout.engine={engine}")
    if rewards is not None:
        components = read_yaml(rewards, f"--rewards {rewards}")
        if not isinstance(components, list):
            raise RecipeError(
                f"--rewards {rewards}: give a YAML list of reward components, as a "
                "recipe's rewards: block holds (- {name: correct, type: math})"
            )
        try:  # checked here, so that an error names this file and not the recipe
            TypeAdapter(list[RewardSpec]).validate_python(components)
        except ValidationError as e:
            raise RecipeError(format_errors(e, f"--rewards {rewards}", "its list")) from None
        out.append(f"rewards={json.dumps(components)}")
    facts = default_facts(tree.get("algorithm"))
    pairs = facts is not None and facts.data == "pairs"
    if prompts is not None:
        if not prompts.exists():
            raise RecipeError(f"--prompts {prompts}: no such file or folder")
        data = tree.get("data", {})
        fmt = (data.get("heldout") or data.get("train") or {}).get("format", "auto")
        src = {"path": str(prompts.resolve())}
        if pairs:
            out.append(f"data.heldout={json.dumps({**src, 'format': fmt})}")
            if facts.head == "score":  # the reward model: the only one that reads it
                out.append("reward_model.eval_pairs=0")
        elif isinstance(tree.get("eval"), dict):
            out += [f"eval.prompts={json.dumps(src)}", "eval.holdout=null"]
        else:
            out.append(f"eval={json.dumps({'prompts': src, 'every_steps': 1})}")
    if k is not None and not pairs:
        out.append(f"eval.k={k}")
    return out


def load_for(
    target: Target,
    recipe_path: Path | None,
    sets: list[str],
    engine: str | None = None,
    rewards: Path | None = None,
    prompts: Path | None = None,
    k: int | None = None,
) -> Recipe:
    """The recipe to evaluate `target` with (`recipe_path`, else the target's own), with
    the options applied before `sets`.

    Raises:
        RecipeError: no recipe, or one that does not load (named).
    """
    path = recipe_path or target.recipe
    if path is None:
        raise RecipeError(
            f"TARGET {target.given}: {'an' if target.kind[0] in 'aeiou' else 'a'} "
            f"{target.kind} carries no recipe of its own; give the "
            "one whose held-out set and rewards to use: --recipe recipes/NAME.yaml"
        )
    tree = read_yaml(path, f"--recipe {path}")
    if not isinstance(tree, dict):
        raise RecipeError(f"--recipe {path}: not a recipe (a mapping of keys)")
    return load_recipe(path, _overrides(tree, engine, rewards, prompts, k) + list(sets))


def evaluate_target(
    given: str,
    recipe_path: Path | None = None,
    sets: list[str] | None = None,
    engine: str | None = None,
    rewards: Path | None = None,
    prompts: Path | None = None,
    k: int | None = None,
    reward_model_dir: Path | None = None,
    out: Path | None = None,
) -> dict[str, Any]:
    """Evaluate TARGET `given` (see the module docstring); returns the report
    {target, kind, model, recipe, evaluation, metric, metrics, items}.

    Raises:
        RecipeError: bad input (a missing or wrong-kind folder, no recipe, no held-out
            set), naming the path and the fix.
    """
    target = resolve_target(given)
    recipe = load_for(target, recipe_path, sets or [], engine, rewards, prompts, k)
    with tempfile.TemporaryDirectory(prefix="posttrain-eval-") as tmp:
        work = out or Path(tmp)
        base = str(resolve_model_path(recipe.model.path))
        if _against_reference(recipe) and target.base is not None:
            # An adapter (a run's final/ too) merged into the base it is scored against:
            # a QLoRA run's merged/ holds the NF4-dequantised base plus the adapter, whose
            # quantisation error would otherwise count as the policy's change.
            target = replace(target, model=None)
        target = materialize(target, work / "model", base)
        kind, result, extra = _dispatch(target, recipe, base, work, reward_model_dir)
    return {
        "target": given,
        "kind": target.kind,
        "model": str(target.model) if out else str(target.folder),
        "recipe": recipe.name,
        "evaluation": kind,
        "metric": result.metric,
        "metrics": {**result.metrics, **extra},
        "items": result.items,
    }


def _dispatch(
    target: Target, recipe: Recipe, base: str, work: Path, reward_model_dir: Path | None
) -> tuple[str, EvalResult, dict[str, float]]:
    """Run the evaluation `target` and `recipe` call for (see the module docstring)."""
    assert target.model is not None  # materialize set it
    if target.head == "score" or recipe.facts.head == "score":
        pairs = _heldout_or_exit(recipe)
        fresh = None if target.head == "score" else recipe.train.seed
        kind = "reward model" if fresh is None else "reward model (untrained score head)"
        return kind, reward_model_eval(target.model, pairs, recipe, fresh_head_seed=fresh), {}
    if _against_reference(recipe):
        pairs = _heldout_or_exit(recipe)
        result = dpo_eval(target.model, base, pairs, recipe)
        extra = {}
        if reward_model_dir is not None:
            extra = win_rate(recipe, str(target.model), base, reward_model_dir, work)
        return "dpo", result, extra
    return "sampling", sample_eval(recipe, target.model, work), {}


def _against_reference(recipe: Recipe) -> bool:
    """DPO's evaluation: held-out pairs scored by the policy's implicit reward, its
    logprob ratio to the reference (the recipe's facts: pairs and a reference)."""
    return recipe.facts.data == "pairs" and recipe.facts.reference


def _heldout_or_exit(recipe: Recipe) -> list[Any]:
    from ..data import load_heldout_pairs

    pairs = load_heldout_pairs(recipe)
    if not pairs:
        raise RecipeError(
            f"recipe {recipe.name}: no held-out pairs (data.heldout); give a file of "
            "pairs with --prompts FILE, or set data.heldout in the recipe"
        )
    return pairs


def win_rate(
    recipe: Recipe, policy: str, reference: str, reward_model_dir: Path, work: Path
) -> dict[str, float]:
    """How often the policy's sample beats the reference's under the reward model at
    `reward_model_dir`, per held-out single-turn prompt (samples of `rollout` settings,
    the mean reward of each prompt's samples compared; ties half): `win_rate`,
    `rm_policy`, `rm_reference` (mean rewards), `win_prompts`.

    Raises:
        RecipeError: `reward_model_dir` is not a reward-model folder.
    """
    t = resolve_target(str(reward_model_dir))
    if t.head != "score" or t.model is None:
        raise RecipeError(
            f"--reward-model {reward_model_dir}: not a reward model folder (a "
            "*ForSequenceClassification model, RUN_DIR/final of an rm recipe)"
        )
    held = recipe.data.heldout
    assert held is not None  # dpo_eval ran on it
    tree = {
        "name": f"{recipe.name}-win-rate",
        "algorithm": "grpo",
        "model": {"path": policy, "dtype": recipe.model.dtype},
        "data": {"train": held.model_dump(exclude_unset=True)},
        "rollout": recipe.rollout.model_dump(exclude_unset=True),
        "rewards": [{"name": "rm", "type": "reward_model", "path": str(t.model)}],
        "train": {"steps": 1, "prompts_per_step": 1},
        "resources": recipe.resources.model_dump(exclude_unset=True),
        "eval": {"prompts": held.model_dump(exclude_unset=True), "every_steps": 1, "k": 1},
    }
    path = work / "win_rate.yaml"
    path.write_text(yaml.safe_dump(tree))
    runs = [
        sample_eval(load_recipe(path, [f"model.path={m}"]), m, work / f"win-{i}")
        for i, m in enumerate((policy, reference))
    ]
    pol, ref = (r.prompt_rewards for r in runs)
    wins = [1.0 if pol[p] > ref[p] else 0.5 if pol[p] == ref[p] else 0.0 for p in pol if p in ref]
    return {
        "win_rate": statistics.fmean(wins),
        "rm_policy": runs[0].metrics["reward_mean"],
        "rm_reference": runs[1].metrics["reward_mean"],
        "win_prompts": float(len(wins)),
    }
