"""The controller's generate for black-box agents (`rollout.agent`, or a verifiers v1
environment's driver: recipes/episodes/vf1.py): every rollout
worker serves its OpenAI-compatible endpoint, the step's episodes go to the user's agent
program as a JSONL file, the program runs, and each episode's recorded calls become a
token-exact `Rollout` (recipes/episodes/agent.py).

Episode file (`$POSTTRAIN_EPISODES`, one JSON object per line): `episode_id` (also the
rollout uid, `{group_id}-{k}`), `base_url` (the OpenAI base URL to call for it: episodes
are spread round-robin over the rollout workers), `messages`, `ground_truth`, `metadata`.
The endpoints sample at `rollout.temperature` and at most `rollout.max_new_tokens` per
call whatever the agent asks, so the learner's logprobs describe what was sampled.

Limits: the endpoints bind 127.0.0.1 (the agent runs on the controller's machine); the
program runs once per step and must finish within `rollout.agent.timeout_s`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...config import Recipe
from .agent import agent_rollout
from .vf1 import DriverFailed, Drivers


class AgentProgramFailed(RuntimeError):
    """The agent program exited non-zero or ran past its timeout (names its log)."""


def _ray_call(worker: Any, verb: str, *args: Any) -> Any:
    import ray

    return ray.get(getattr(worker, verb).remote(*args))


def generate_agent_episodes(
    workers: list[Any],
    requests: list[Any],
    recipe: Recipe,
    decode: Callable[[list[int]], str],
    folder: Path,
    step: int,
    call: Callable[..., Any] = _ray_call,
    drivers: Drivers | None = None,
) -> tuple[list[Any], dict[str, float]]:
    """Run the agent program over `samples_per_prompt` episodes per request.

    Args:
        workers: the rollout workers (Ray handles; `call` invokes their verbs).
        requests: the step's `PromptRequest`s.
        decode: ids → text (the policy's tokenizer).
        folder: where the episode file and the program's log go.
        drivers: the run's verifiers v1 drivers (`Roles.vf1_drivers`), kept up between
            steps; None: a driver started and stopped with this step.

    Returns:
        One Rollout per episode in request order, and the step's agent metrics.

    Raises:
        AgentProgramFailed: the program failed or timed out.
        AgentEpisodeError: an episode got no call.
    """
    r = recipe.rollout
    urls = [
        call(w, "serve_openai", "127.0.0.1", 0, r.max_new_tokens, r.temperature, step)
        for w in workers
    ]
    episodes, file = _write_episodes(requests, urls, r.samples_per_prompt, folder, step)
    _run_agent_program(recipe, file, folder, step, drivers)
    rollouts = [
        agent_rollout(
            uid,
            req.group_id,
            call(workers[w], "pop_episode", uid),
            decode,
            req.ground_truth,
            req.metadata,
        )
        for uid, req, w in episodes
    ]
    return rollouts, _agent_metrics(rollouts)


def _write_episodes(
    requests: list[Any], urls: list[str], samples_per_prompt: int, folder: Path, step: int
) -> tuple[list[tuple[str, Any, int]], Path]:
    """Write the step's episode file, one JSON line per episode, each episode on a
    worker in turn.

    Returns:
        `(uid, request, worker index)` per episode in request order, and the file.
    """
    folder.mkdir(parents=True, exist_ok=True)
    episodes, lines = [], []
    for req in requests:
        for k in range(samples_per_prompt):
            uid, w = f"{req.group_id}-{k}", len(episodes) % len(urls)
            episodes.append((uid, req, w))
            lines.append(
                json.dumps(
                    {
                        "episode_id": uid,
                        "base_url": urls[w],
                        "messages": req.messages,
                        "ground_truth": req.ground_truth,
                        "metadata": req.metadata,
                    }
                )
            )
    file = folder / f"episodes_{step:05d}.jsonl"
    file.write_text("\n".join(lines) + "\n")
    return episodes, file


def _run_agent_program(
    recipe: Recipe, file: Path, folder: Path, step: int, drivers: Drivers | None = None
) -> None:
    """Run `rollout.agent.command` on the episode file, its output to the step's log (a
    verifiers v1 environment: its driver, kept up between steps by `drivers`,
    recipes/episodes/vf1.py).

    Raises:
        AgentProgramFailed: it ran past `rollout.agent.timeout_s` or exited non-zero.
    """
    log = folder / f"agent_{step:05d}.log"
    if recipe.rollout.agent is None:
        own = Drivers() if drivers is None else None
        log.write_text("")
        try:
            (drivers or own).run_step(recipe.rollout.environment, file, log)
        except DriverFailed as e:
            tail = log.read_text(errors="replace")[-800:]
            raise AgentProgramFailed(
                f"step {step}: the verifiers driver {e} (rollout.environment.step_timeout_s "
                f"bounds a step); {log} ends:\n{tail}"
            ) from e
        finally:
            if own is not None:
                own.stop()
        return
    agent = recipe.rollout.agent
    env = {**os.environ, "POSTTRAIN_EPISODES": str(file), "POSTTRAIN_STEP": str(step)}
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                agent.command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=agent.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise AgentProgramFailed(
                f"step {step}: the agent program ran past "
                f"its timeout ({agent.timeout_s:g} s: rollout.agent.timeout_s); see {log}"
            ) from e
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-800:]
        raise AgentProgramFailed(
            f"step {step}: the agent program exited {proc.returncode}; {log} ends:\n{tail}"
        )


def _agent_metrics(rollouts: list[Any]) -> dict[str, float]:
    """The step's agent metrics: completions per episode (mean, max), dropped calls,
    and how many episodes the agent rewarded."""
    calls = [sum(t["mask"] for t in x.turns) for x in rollouts]
    return {
        "episode/turns_mean": sum(calls) / len(calls),
        "episode/turns_max": float(max(calls)),
        "episode/dropped_calls": float(sum(x.metadata["dropped_calls"] for x in rollouts)),
        "episode/agent_rewards": float(sum("environment_reward" in x.metadata for x in rollouts)),
    }
