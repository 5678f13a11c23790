"""A verifiers 0.4 (`verifiers.v1`) environment as posttrain episodes
(`rollout.environment: {type: verifiers, api: v1}`), on posttrain's black-box agent
path (agent_step.py): each step, vf1_driver.py runs the step's episodes with verifiers
itself (its harness, its rubric) in `rollout.environment.python`, every model call of
its harness sampled and recorded token-exactly by a rollout worker's OpenAI-compatible
endpoint (actors/openai_server.py, agent.py), and posts each episode's reward: the
trace's weighted reward sum, each `@vf.reward` score a component. The prompts:
recipes/data/vf1_tasks.py.
"""

from __future__ import annotations

from ...config.episodes import AgentProgram, VerifiersEnvironment
from ..data.vf1_tasks import driver_command


def vf1_agent(cfg: VerifiersEnvironment) -> AgentProgram:
    """The agent program of a step: the driver running the step's episodes within
    `cfg.step_timeout_s`."""
    return AgentProgram(command=driver_command(cfg, "run"), timeout_s=cfg.step_timeout_s)
