"""Multi-turn rollouts (`rollout.max_turns`, `rollout.max_episode_tokens`,
`rollout.tools`, `rollout.environment`): pydantic only, no ML imports.

An episode is multi-turn when `rollout.max_turns > 1`: the model samples a turn, the
tools or the environment answer with new messages, and so on (recipes/episodes/multiturn.py).
With the defaults (`max_turns: 1`, no tools, no environment) a rollout is the
single-turn sample it always was.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Strict
from .env_server import EnvironmentServe, check_serve


class PythonTool(Strict):
    """The built-in `python` tool: the model writes
    `<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`; the code
    runs in the code sandbox (rewards/sandbox.py) and its output comes back as a `tool`
    message."""

    name: Literal["python"] = Field(description="The tool's name in the model's tool calls.")
    timeout_s: float = Field(
        5.0,
        gt=0,
        description="Wall-clock limit of one call, seconds; a call over it returns "
        "'[timed out after N s]' as its result (counted in tool_errors).",
    )
    max_output_tokens: int = Field(
        128,
        gt=0,
        description="Most tokens of a call's output put back into the episode; "
        "longer output is cut and ends with '[... output truncated]'.",
    )
    memory_mb: int = Field(512, ge=64, description="Address-space limit of the program, MiB.")
    sandbox: Literal["bwrap", "none"] = Field(
        "bwrap",
        description="'bwrap' (bubblewrap, no network, read-only system; see "
        "rewards/sandbox.py) or 'none' (a bare subprocess: trusted code only).",
    )


class _RemoteEnvironment(Strict):
    """What every environment reached over the network shares: where, the token, the
    deadline and retries of each request, and the most bytes one answer may carry."""

    url: str = Field(
        description="Base URL of the environment server; with serve, '{port}' in it "
        "becomes the free port the server was started on."
    )
    token_env: str | None = Field(
        None,
        description="Environment variable holding a bearer token sent as "
        "'Authorization: Bearer <token>'.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Deadline for each whole request, seconds: connect, send and the "
        "complete response, however slowly it arrives; then retried.",
    )
    retries: int = Field(2, ge=0, description="Retries of a failed or timed-out request.")
    max_message_bytes: int = Field(
        1_000_000,
        gt=0,
        description="Most bytes of one answer (a reset or step response); a bigger "
        "one fails its episode.",
    )
    serve: EnvironmentServe | None = Field(
        None,
        description="Start the server for the run on this machine (config/env_server.py); "
        "None: it runs already at url.",
    )

    @model_validator(mode="after")
    def _servable(self) -> _RemoteEnvironment:
        check_serve(self.url, self.serve)
        return self


class HttpEnvironment(_RemoteEnvironment):
    """A user's environment over HTTP (README, 'Multi-turn and tools'): `POST /reset`
    with the data item returns the first messages, `POST /step` with the model's message
    returns new messages, an optional reward and `done`."""

    type: Literal["http"] = Field(description="An environment served over HTTP.")


class OpenEnvEnvironment(_RemoteEnvironment):
    """An OpenEnv environment server (Meta's `openenv-core` wire protocol; docs/multi-turn.md):
    `reset` / `step` / `state` over its WebSocket `/ws` (one session per episode) or its
    HTTP routes. The model's text goes into the action as `action_key`; the observation's
    `observation_key` (or the whole observation as JSON) comes back as a message."""

    type: Literal["openenv"] = Field(description="An OpenEnv environment server.")
    transport: Literal["websocket", "http"] = Field(
        "websocket",
        description="'websocket': a session per episode on {url}/ws (OpenEnv's stateful "
        "transport); 'http': POST {url}/reset and {url}/step (OpenEnv serves each HTTP "
        "request from a fresh environment: only for servers that keep their own state).",
    )
    action_key: str = Field(
        "message", min_length=1, description="Action field that carries the model's text."
    )
    action_args: dict[str, Any] = Field(
        default_factory=dict, description="Fixed fields added to every action."
    )
    reset_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields added to every reset (after episode_id and seed).",
    )
    observation_key: str | None = Field(
        None,
        description="Observation field whose text becomes the environment's message; "
        "None: the whole observation as JSON (sorted keys).",
    )
    prompt: Literal["item", "observation"] = Field(
        "item",
        description="What the model starts from: 'item' (the data item's messages) or "
        "'observation' (the system prompt, then the reset observation as the user message).",
    )
    message_role: Literal["user", "tool"] = Field(
        "user", description="Role of the observation messages in the conversation."
    )
    mcp_tools: bool = Field(
        False,
        description="The server is an MCP environment: its tools are listed at reset "
        "(action type list_tools) and shown in the system message; each "
        '<tool_call>{"name", "arguments"}</tool_call> of a model turn is a call_tool '
        "action whose result comes back as a tool message; a turn without a call is the "
        "ordinary action_key action.",
    )


class VerifiersEnvironment(Strict):
    """A Prime Intellect `verifiers` environment (docs/multi-turn.md).

    `api: classic` (verifiers 0.1.9-0.3, `MultiTurnEnv`): `load_environment(**args)` of
    an installed environment `name` or an importable `module`; its dataset gives the
    prompts (`data.train: {environment: train}`), its `env_response` / `is_completed`
    the episode, its rubric the reward. `api: v1` (verifiers 0.4, `verifiers.v1`): the
    taskset `name` / `module` (with `args` its taskset config) runs its own episodes, its
    harness sampling through the rollout workers' OpenAI-compatible endpoint as a
    black-box agent (recipes/episodes/vf1.py), its `@vf.reward` functions the reward."""

    type: Literal["verifiers"] = Field(description="A verifiers environment.")
    api: Literal["classic", "v1"] = Field(
        "classic",
        description="'classic': the MultiTurnEnv contract (verifiers 0.1.9-0.3), run turn "
        "by turn here; 'v1': a verifiers 0.4 `verifiers.v1` taskset + harness, run by "
        "verifiers itself against the rollout workers' endpoint.",
    )
    name: str | None = Field(
        None,
        description="Installed environment id (classic: verifiers.load_environment; v1: "
        "the taskset id).",
    )
    module: str | None = Field(
        None,
        description="Importable module (classic: with `load_environment(**args)`; v1: "
        "exporting its Taskset subclass in `__all__`).",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of load_environment (classic) or fields of the "
        "taskset config (v1).",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="Deadline of each call into the environment (env_response, "
        "is_completed, the rubric), seconds; over it the episode fails. v1: of each "
        "episode (verifiers' `timeout.episode`).",
    )
    python: str | None = Field(
        None,
        description="v1: the Python interpreter that runs verifiers (a venv with "
        "verifiers>=0.4, which pins openai<3 and mcp==2.0.0); default posttrain's own.",
    )
    harness: dict[str, Any] = Field(
        default_factory=dict,
        description="v1: the agent seat's harness config, e.g. {id: 'null'} (verifiers' "
        "tool-less chat loop); default the taskset's own.",
    )
    max_concurrent: int = Field(
        8,
        ge=1,
        description="v1: episodes verifiers runs at once per step. Their model calls "
        "are sampled together, so up to a step's episodes is faster with the `null` "
        "harness (examples/vf1_sums.yaml: 64); a harness that starts a program per "
        "episode spends CPU per episode, where more at once does not help.",
    )
    step_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="v1: most seconds verifiers may take for one step's episodes; over "
        "it the step fails.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> VerifiersEnvironment:
        if (self.name is None) == (self.module is None):
            raise ValueError(
                "rollout.environment (type verifiers): give exactly one of name (an "
                "installed environment id) or module (an importable module)"
            )
        v1_only = [k for k in ("python", "harness") if getattr(self, k)]
        if self.api == "classic" and v1_only:
            raise ValueError(
                f"rollout.environment (type verifiers): {v1_only[0]} is a key of api: v1 "
                "(verifiers 0.4); set api: v1 or remove it"
            )
        return self

    @property
    def label(self) -> str:
        """The environment's name or module, for messages and `data_source`."""
        return self.name or self.module or ""


class PythonEnvironment(Strict):
    """A user's environment as a Python class `module:Class` (constructed with no
    arguments per episode) with `reset(item) -> list[message]` and
    `step(message) -> {"messages": [...], "reward": float | None, "done": bool}`."""

    type: Literal["python"] = Field(description="An environment class imported by name.")
    class_path: str = Field(
        description="'package.module:ClassName' importable on the controller's path."
    )


class AgentProgram(Strict):
    """A black-box agent program run once per step (README, 'Multi-turn and tools'). It
    reads the step's episodes from the JSONL file named by $POSTTRAIN_EPISODES (one line
    each: `episode_id`, `base_url`, `messages`, `ground_truth`, `metadata`), calls
    `{base_url}/chat/completions` with each episode id, may post each episode's reward
    to `{base_url}/episodes/{episode_id}/reward`, and exits 0."""

    command: list[str] = Field(
        min_length=1, description="argv of the agent program, e.g. ['python', 'agent.py']."
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="Most seconds the program may run per step; over it the step fails.",
    )


class EpisodeFields(Strict):
    """The rollout block's multi-turn keys (`RolloutConfig` inherits them)."""

    @property
    def episodic(self) -> bool:
        """Whether a step samples episodes (multi-turn, or a black-box agent) instead of
        single-turn rollouts."""
        return self.max_turns > 1 or self.agent_driven

    @property
    def agent_driven(self) -> bool:
        """Whether a program outside posttrain drives the episodes through the rollout
        workers' OpenAI-compatible endpoint: `rollout.agent`, or a verifiers v1
        environment."""
        env = self.environment
        return self.agent is not None or (isinstance(env, VerifiersEnvironment) and env.api == "v1")

    max_turns: int = Field(1, ge=1, description="Most model turns per episode (1: single-turn).")
    max_episode_tokens: int | None = Field(
        None,
        gt=0,
        description="Most tokens after the prompt per episode (model and "
        "environment tokens); default max_turns × max_new_tokens.",
    )
    tools: list[PythonTool] = Field(default_factory=list, description="Tools the model may call.")
    environment: (
        HttpEnvironment | OpenEnvEnvironment | PythonEnvironment | VerifiersEnvironment | None
    ) = Field(None, discriminator="type", description="A user's environment answering each turn.")
    agent: AgentProgram | None = Field(
        None, description="A black-box agent program calling an OpenAI-compatible endpoint."
    )


def check_episodes(
    algorithm: str,
    rollout: EpisodeFields,
    dynamic_sampling: bool,
    overlong_buffer: int | None = None,
) -> None:
    """Refuse multi-turn settings the run cannot honour.

    Raises:
        ValueError: names the key and the fix.
    """
    max_turns, tools, environment, agent = (
        rollout.max_turns,
        rollout.tools,
        rollout.environment,
        rollout.agent,
    )
    vf1 = rollout.agent_driven and agent is None
    if vf1 and max_turns > 1:
        raise ValueError(
            "rollout.max_turns counts posttrain's own turns, but a verifiers api: v1 "
            "environment's harness decides its turns; remove rollout.max_turns"
        )
    if (tools or environment is not None) and max_turns < 2 and not vf1:
        raise ValueError(
            "rollout.tools / rollout.environment answer the model between turns, "
            "but rollout.max_turns is 1; set rollout.max_turns: 2 or more"
        )
    if agent is not None and (tools or environment is not None):
        raise ValueError(
            "rollout.agent drives its own episodes; remove rollout.tools and "
            "rollout.environment, or rollout.agent"
        )
    who = "rollout.agent" if agent is not None else "rollout.environment (verifiers api: v1)"
    if rollout.agent_driven and algorithm != "grpo":
        raise ValueError(
            f"{who} trains with sequence-level advantages; algorithm "
            f"{algorithm} is not supported, set algorithm: grpo"
        )
    if rollout.agent_driven and dynamic_sampling:
        raise ValueError(f"grpo.dynamic_sampling is not supported with {who} yet")
    if rollout.agent_driven:  # its program's requests carry these; the recipe's would be ignored
        fields = type(rollout).model_fields
        for key in ("stop", "max_episode_tokens"):
            if key in rollout.model_fields_set and getattr(rollout, key) != fields[key].default:
                raise ValueError(
                    f"rollout.{key} is not read by {who}: its program's calls give their own "
                    "`stop` and `max_tokens` (each call at most rollout.max_new_tokens "
                    f"tokens); remove rollout.{key}"
                )
    if tools and environment is not None:
        raise ValueError(
            "rollout.tools and rollout.environment are both set; an episode has "
            "one source of environment messages: keep one"
        )
    if max_turns > 1 and algorithm not in ("grpo", "ppo"):
        raise ValueError(
            f"rollout.max_turns > 1 trains on episodes (environment tokens masked) with "
            f"grpo or ppo; algorithm {algorithm} is not supported, set algorithm: grpo "
            f"or algorithm: ppo"
        )
    if rollout.episodic and overlong_buffer is not None:
        raise ValueError(
            "grpo.overlong_buffer penalises responses near rollout.max_new_tokens, "
            "but an episode's response holds several turns and environment "
            "tokens; remove grpo.overlong_buffer for multi-turn or agent episodes"
        )
    if max_turns > 1 and dynamic_sampling:
        raise ValueError(
            "grpo.dynamic_sampling is not supported with multi-turn episodes "
            "(rollout.max_turns > 1) yet; set grpo.dynamic_sampling: false"
        )
