"""The controller's multi-turn generate (`rollout.max_turns > 1`): wires the rollout
workers (`generate_ids`) and the recipe's tools or environment into
`recipes.episodes.multiturn.run_episodes`, and reports the episode metrics.

Concurrency: each turn sends the running episodes' token ids to the rollout workers
(spread round-robin, one Ray call per worker) and waits for all of them; environment
steps then run on a few controller threads. A rollout worker that dies mid-episode
stops the step (no per-turn replacement yet).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import ray

from ...actors.engine import Sample
from ...actors.rollout import PromptRequest, Rollout, SamplingSettings
from ...config import Recipe
from ...rewards.protocol import Score, is_finite_number
from ..data.items import PromptItem, chat_messages
from .multiturn import (
    Environment,
    Episode,
    finish_episodes,
    run_episodes,
    start_episodes,
    to_rollout,
)
from .tools import ToolEnvironment, make_tools


@lru_cache(maxsize=4)
def policy_tokenizer(model_path: str) -> Any:
    """The policy's tokenizer (with its chat template), loaded once per controller."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


_TOOLS: dict[tuple[str, str], dict[str, Any]] = {}


def environment_factory(recipe: Recipe, tokenizer: Any, step: int, url: str | None = None):
    """`uid -> Environment` for the recipe: its tools (built once per run: the sandbox
    starts with a trial run) or its user environment (at `url` when given: the server
    the run started, `rollout.environment.serve`)."""
    r = recipe.rollout
    if r.environment is not None:
        from .environments import make_environment

        config = r.environment if url is None else r.environment.model_copy(update={"url": url})
        return lambda uid: make_environment(config, f"{uid}@{step}")
    key = (tokenizer.name_or_path, repr(r.tools))
    if key not in _TOOLS:
        _TOOLS[key] = make_tools(r.tools, tokenizer)
    tools = _TOOLS[key]
    return lambda uid: ToolEnvironment(tools)


def worker_generate(roles: Any, step: int):
    """A `GenerateFn` over the run's rollout workers: prompts spread round-robin."""

    def generate(prompts: list[list[int]], sampling: SamplingSettings) -> tuple[list[Sample], int]:
        n = len(roles.rollout)
        parts = {i: list(range(i, len(prompts), n)) for i in range(n) if i < len(prompts)}
        futures = {
            i: roles.rollout[i].generate_ids.remote([prompts[j] for j in idx], sampling, step)
            for i, idx in parts.items()
        }
        out: list[Sample | None] = [None] * len(prompts)
        versions = set()
        for i, f in futures.items():
            samples, version = ray.get(f)
            versions.add(version)
            for j, s in zip(parts[i], samples, strict=True):
                out[j] = s
        return out, min(versions)

    return generate


def requests_for(
    prompts: list[PromptItem], recipe: Recipe, step: int, tag: str = "s"
) -> list[PromptRequest]:
    """The step's prompts as chat requests (system prompt first when the recipe has one),
    group ids as single-turn generation names them (`tag`: `s` training, `e` evaluation)."""
    out = []
    for i, p in enumerate(prompts):
        m = chat_messages(p, recipe.model.system_prompt)
        gid = f"{tag}{step}-p{p.prompt_id}-{i}"
        out.append(PromptRequest(gid, m, p.ground_truth, p.metadata))
    return out


def episodes_enabled(recipe: Recipe) -> bool:
    """Whether a step samples episodes (multi-turn, or a black-box agent) instead of
    single-turn rollouts."""
    return recipe.rollout.episodic


def generate_episodes(
    roles: Any,
    prompts: list[PromptItem],
    recipe: Recipe,
    model_path: str,
    step: int,
    run_dir: Path | None = None,
    n: int | None = None,
    sampling: SamplingSettings | None = None,
    tag: str = "s",
) -> tuple[list[Rollout], dict[str, float]]:
    """`samples_per_prompt` episodes per prompt (`n` when given: an evaluation's k) as
    Rollouts (with `loss_mask` and `turns`), and the step's episode metrics: turn by turn
    with the recipe's tools or environment, or by the recipe's agent program (its files
    under `run_dir/agent`). `sampling` replaces the rollout's settings for each model
    turn (an evaluation's temperature and seed; its `n` is ignored: one per turn); `tag`
    starts the group ids (`e`: an evaluation, whose environments then reset alike at
    every policy version).

    Raises:
        TemplateMismatch: the chat template cannot be extended turn by turn.
        SandboxUnavailable: a tool's sandbox cannot start.
    """
    r = recipe.rollout
    tok = policy_tokenizer(model_path)
    if r.agent_driven:  # an agent program or verifiers v1 (recipes/episodes/agent_step.py)
        from .agent_step import generate_agent_episodes

        if n is not None or sampling is not None:  # the agent's endpoints read the recipe
            update: dict[str, Any] = {"samples_per_prompt": n or r.samples_per_prompt}
            if sampling is not None:
                update.update(temperature=sampling.temperature)
            recipe = recipe.model_copy(update={"rollout": r.model_copy(update=update)})

        return generate_agent_episodes(
            roles.rollout,
            requests_for(prompts, recipe, step, tag),
            recipe,
            lambda ids: tok.decode(ids, skip_special_tokens=True),
            (run_dir or Path(".")) / "agent",
            step,
            drivers=getattr(roles, "vf1_drivers", None),
        )
    turn = SamplingSettings(
        n=1,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        seed=recipe.train.seed * 100_003 + step,
        stop=tuple(r.stop),
    )
    if sampling is not None:
        turn = replace(sampling, n=1)
    server = getattr(roles, "env_server", None)  # rollout.environment.serve's
    new_env: Any = environment_factory(recipe, tok, step, server and server.url)
    budget = r.max_episode_tokens or r.max_turns * r.max_new_tokens
    context, where = engine_context(recipe, model_path)
    episodes = start_episodes(
        tok,
        requests_for(prompts, recipe, step, tag),
        n or r.samples_per_prompt,
        new_env,
        None if context is None else context - budget,
        f"{where} minus the episode budget of {budget} tokens (rollout.max_episode_tokens)",
    )
    run_episodes(worker_generate(roles, step), tok, episodes, turn, r.max_turns, budget)
    finish_episodes(episodes)
    close_all([e.env for e in episodes])
    texts = {id(e.prompt_ids): tok.decode(e.prompt_ids, skip_special_tokens=True) for e in episodes}
    version = min((t.policy_version for e in episodes for t in e.turns if t.mask), default=step)
    rollouts = [to_rollout(e, texts[id(e.prompt_ids)], version) for e in episodes]
    return rollouts, episode_metrics(episodes)


def engine_context(recipe: Recipe, model_path: str) -> tuple[int | None, str]:
    """The most tokens (prompt + response) the rollout engine takes, and where that
    number comes from: `rollout.vllm.max_model_len` with engine vllm when set, else the
    model's context (config.json); None when neither names one."""
    v = recipe.rollout.vllm.max_model_len
    if recipe.rollout.engine == "vllm" and v:
        return v, f"rollout.vllm.max_model_len {v}"
    from ..preflight import model_context

    config = Path(model_path) / "config.json"
    n = model_context(config)
    return n, f"the model's context of {n} tokens ({config})"


def close_all(envs: list[Environment]) -> None:
    """Let environments that hold resources (HTTP clients) release them."""
    for env in envs:
        close = getattr(env, "close", None)
        if close is not None:
            close()


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Turns per episode (model turns), tool calls / errors / seconds per step, the share
    of truncated episodes, the share of response tokens that are the model's, and the
    episodes failed by their environment (each named in its failed score's error)."""
    model = sum(t.mask * len(t.ids) for e in episodes for t in e.turns)
    total = sum(e.response_len for e in episodes)
    return {
        "episode/turns_mean": statistics.fmean(e.model_turns for e in episodes),
        "episode/turns_max": float(max(e.model_turns for e in episodes)),
        "episode/tool_calls": float(sum(e.stats.tool_calls for e in episodes)),
        "episode/tool_calls_per_episode": statistics.fmean(e.stats.tool_calls for e in episodes),
        "episode/tool_errors": float(sum(e.stats.tool_errors for e in episodes)),
        "episode/tool_time_s": sum(e.stats.tool_time_s for e in episodes),
        "episode/truncated_fraction": sum(e.truncated for e in episodes) / len(episodes),
        "episode/episodes_with_tool_call": float(sum(e.stats.tool_calls > 0 for e in episodes)),
        "episode/model_token_fraction": model / max(total, 1),
        "episode/environment_errors": float(sum(e.error is not None for e in episodes)),
    }


def add_environment_rewards(rollouts: list[Rollout], scores: list[Score]) -> list[Score]:
    """Scores with each episode's environment reward (`metadata['environment_reward']`,
    the sum of its `/step` rewards, or the agent's posted reward) added as the
    `environment` component (weight 1), with its parts (a verifiers rubric's
    functions, `metadata['environment_components']`) beside it. A failed score (reward
    None) stays failed; a failed episode (`metadata['episode_error']`: never run, a
    failing environment, or a non-finite environment reward) fails its score with that
    error, as does a sum that is not finite."""
    out = []
    for r, s in zip(rollouts, scores, strict=True):
        env = r.metadata.get("environment_reward")
        error = r.metadata.get("episode_error")
        if error is None and env is not None and s.reward is not None:
            total = s.reward + env
            if is_finite_number(total):
                parts = r.metadata.get("environment_components") or {}
                details = {**parts, **s.details, "environment": env}  # recipe's names win
                out.append(s.model_copy(update={"reward": total, "details": details}))
                continue
            error = f"episode {r.uid}: reward {s.reward!r} + environment reward {env!r} = {total!r}"
        if error is None:
            out.append(s)
        else:
            error = f"{error}; {s.error}" if s.error else error
            out.append(Score(uid=s.uid, reward=None, error=error, details=s.details))
    return out
