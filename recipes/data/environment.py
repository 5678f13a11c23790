"""Verifiers environments as data: loading one (`load_verifiers`), checking that it has
the contract posttrain runs (`check_contract`), and its dataset as prompts
(`environment_items`, the source `{environment: train | eval}`).

The contract (Prime Intellect `verifiers`, the classic `MultiTurnEnv` of 0.1.9–0.3.x,
written against its documented API; no verifiers package is imported unless `name` asks
for `verifiers.load_environment`):
- `load_environment(**args)` returns the environment;
- `dataset` (or `get_dataset()`), `eval_dataset` (or `get_eval_dataset()`): rows with
  `prompt` (messages or text) or `question`, and `answer`, `info`, `task`;
  `system_prompt` goes in front of a `question`;
- `async env_response(messages, state) -> messages` (or `(messages, state)`),
  `async is_completed(state)` (or `(messages, state)`), optional `setup_state(state)`;
- `rubric`: reward functions `funcs` with `weights` (or `get_reward_funcs()` /
  `get_reward_weights()`; a `RubricGroup`'s `rubrics`), each called with the arguments
  it names of `prompt, completion, answer, state, task, info, parser`.

Refused, naming what is missing (at `posttrain validate`): an environment without
`env_response` or `is_completed` (verifiers 0.4's `verifiers.v1` environments: a Taskset
and a Harness that sample through their own OpenAI client; run those with `api: v1`,
vf1_tasks.py), native tool calling (`oai_tools` / `tool_defs`: posttrain's episodes
are token in, token out; give tools as text in `env_response`), group reward functions
(`states`, `completions`... arguments), and a dataset it cannot read.
"""

from __future__ import annotations

import importlib
import inspect
import json
from functools import lru_cache
from typing import Any

from ...config import RecipeError
from ...config.episodes import VerifiersEnvironment
from .items import PromptItem, check_messages

#: Arguments of a reward function that score a whole group (verifiers' group functions).
GROUP_ARGS = ("states", "completions", "prompts", "answers")


def load_verifiers(cfg: VerifiersEnvironment) -> Any:
    """The environment `cfg` names, checked (`check_contract`); loaded once per process
    and configuration.

    Raises:
        RecipeError: it cannot be imported or loaded, or lacks part of the contract.
    """
    return _load(cfg.model_dump_json())


@lru_cache(maxsize=8)
def _load(key: str) -> Any:
    cfg = VerifiersEnvironment.model_validate_json(key)
    where = f"rollout.environment ({cfg.label})"
    try:
        if cfg.module is not None:
            load = importlib.import_module(cfg.module).load_environment
            env = load(**cfg.args)
        else:
            import verifiers

            load = getattr(verifiers, "load_environment", None)
            if load is None:
                raise RecipeError(
                    f"{where}: verifiers {getattr(verifiers, '__version__', '?')} has no "
                    "verifiers.load_environment (0.4 moved to verifiers.v1): for a v1 "
                    "taskset set api: v1, else install verifiers<0.4 or give module: the "
                    "environment's module"
                )
            env = load(cfg.name, **cfg.args)
    except RecipeError:
        raise
    except Exception as e:  # the user's module: any failure to load is a recipe error
        raise RecipeError(
            f"{where}: cannot load the environment: {type(e).__name__}: {e}; give module: "
            "an importable module with load_environment(**args), or name: an installed id"
        ) from e
    check_contract(env, where)
    return env


def check_contract(env: Any, where: str) -> None:
    """Refuse an environment posttrain cannot run exactly (module docstring).

    Raises:
        RecipeError: names the missing or unsupported part and the fix.
    """
    kind = type(env).__name__
    for method in ("env_response", "is_completed"):
        if not callable(getattr(env, method, None)):
            raise RecipeError(
                f"{where}: {kind} has no {method}(); posttrain runs verifiers' MultiTurnEnv "
                "contract (env_response, is_completed, rubric; verifiers 0.1.9-0.3). A "
                "verifiers 0.4 (verifiers.v1) Taskset/Harness environment samples through "
                "its own OpenAI client: set rollout.environment.api: v1"
            )
    for attr in ("oai_tools", "tool_defs"):
        if getattr(env, attr, None):
            raise RecipeError(
                f"{where}: {kind}.{attr} asks for native tool calls (the OpenAI tools API), "
                "which posttrain's token-in-token-out episodes do not parse; give the tools "
                "as text the environment reads in env_response"
            )
    for func, _ in reward_functions(env, where):
        params = inspect.signature(func).parameters
        group = [p for p in GROUP_ARGS if p in params]
        if group:
            raise RecipeError(
                f"{where}: the reward function {func.__name__} scores a group ({group[0]}); "
                "posttrain scores one episode at a time: write it per rollout"
            )


def reward_functions(env: Any, where: str) -> list[tuple[Any, float]]:
    """The rubric's (function, weight) pairs, a RubricGroup's flattened.

    Raises:
        RecipeError: no rubric, or no reward function in it.
    """
    rubric = getattr(env, "rubric", None)
    rubrics = list(getattr(rubric, "rubrics", None) or [rubric] if rubric is not None else [])
    out: list[tuple[Any, float]] = []
    for r in rubrics:
        funcs = getattr(r, "funcs", None)
        weights = getattr(r, "weights", None)
        if funcs is None and hasattr(r, "get_reward_funcs"):
            funcs, weights = r.get_reward_funcs(), r.get_reward_weights()
        funcs = list(funcs or [])
        weights = list(weights or [1.0] * len(funcs))
        if len(weights) != len(funcs):
            raise RecipeError(
                f"{where}: the rubric has {len(funcs)} functions, {len(weights)} weights"
            )
        out += list(zip(funcs, [float(w) for w in weights], strict=True))
    if not out:
        raise RecipeError(f"{where}: the environment has no rubric with reward functions")
    return out


def environment_items(
    cfg: Any, split: str, key: str, limit: int | None, data_source: str | None
) -> list[PromptItem]:
    """The prompts of `{environment: split}`: the verifiers environment's dataset rows.

    Raises:
        RecipeError: `rollout.environment` is not a verifiers one, or a row cannot be read
            (names the environment, split, row and key).
    """
    if not isinstance(cfg, VerifiersEnvironment):
        raise RecipeError(
            f"{key}: {{environment: {split}}} takes the prompts of rollout.environment's "
            "dataset, which only type verifiers has; set rollout.environment: {type: "
            "verifiers, module: ...} or give the prompts another source"
        )
    if cfg.api == "v1":  # verifiers 0.4: its taskset, read by verifiers' own interpreter
        from .vf1_tasks import vf1_items

        return vf1_items(cfg, split, key, limit, data_source)
    env = load_verifiers(cfg)
    rows = _dataset(env, split)
    if rows is None:
        raise RecipeError(f"{key}: environment {cfg.label} has no dataset")
    system = getattr(env, "system_prompt", None)
    items = []
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        where = f"environment {cfg.label} {split} row {i}"
        items.append(
            _item(i, dict(row), where, key, system, data_source or f"verifiers:{cfg.label}")
        )
    return items


def _dataset(env: Any, split: str) -> Any:
    names = ("eval_dataset", "dataset") if split == "eval" else ("dataset",)
    for name in names:
        getter = getattr(env, f"get_{name}", None)
        got = getter() if callable(getter) else getattr(env, name, None)
        if got is not None:
            return got
    return None


def _item(
    i: int, row: dict[str, Any], where: str, key: str, system: Any, source: str
) -> PromptItem:
    prompt = row.get("prompt")
    if prompt is None:
        question = row.get("question")
        if not isinstance(question, str):
            raise RecipeError(f"{where}: no 'prompt' and no text 'question' ({key})")
        prompt = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}
        ]
    elif isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    messages = check_messages(prompt, where, "prompt")
    info = row.get("info") or {}
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except ValueError as e:
            raise RecipeError(f"{where}: 'info' is text but not JSON ({e}); {key}") from e
    question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    metadata = {"data_source": source, "info": info, "task": row.get("task")}
    return PromptItem(i, question, str(row.get("answer", "")), metadata, messages, where)
