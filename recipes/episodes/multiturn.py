"""Multi-turn episodes, token in and token out: the model samples a turn, an
`Environment` (the built-in tools, a user's environment) answers with messages, and so
on until the environment says done, `max_turns` model turns were sampled, or the
episode's token budget runs out.

Token bookkeeping (the point of this module): an episode is kept as token ids and is
never re-tokenised.
- Model turns are the engine's sampled ids exactly, with their `inference_logprobs`.
- Environment messages are the chat template's *delta*: the conversation rendered with
  the new messages (and the generation prompt) minus the conversation rendered without
  them; the rendering without them must be a prefix of the rendering with them, else
  `TemplateMismatch` (a template that rewrites earlier turns, e.g. one dropping past
  reasoning, cannot be extended turn by turn). What the template puts after an
  assistant's content (`<|im_end|>\\n`) but the model did not sample (the `\\n`; the whole
  closing when a stop string ended the turn) goes before the delta, as environment
  tokens.
- `loss_mask` is 1 on model tokens only; the learner trains on the whole trajectory with
  it as the response mask, so environment tokens are context, never targets.

Who drives what: this module knows an engine only as a `GenerateFn` and an environment
only as an `Environment`; the controller (recipes/episodes/step.py) wires the rollout
workers and the tools or user environments to it.

Failed samples (`error` set; the other episodes go on): an environment that raises or
answers with the wrong types (at `reset`: the episode never runs; at `step`: it ends,
its sampled turns kept); a first prompt too long for the engine with the episode's
budget (never sent: a sample without response tokens); a non-finite step reward or sum
(`NaN`, `1e400`). The sample's score fails with `error`, naming episode and environment
(step.py `add_environment_rewards`), and `on_reward_failure` decides.

Limits: a turn cut by `max_new_tokens` (or by the budget) ends its episode (truncated);
environment steps of one turn run on a few threads, model turns of all running episodes
are one engine call per turn.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from ...actors.chat import TemplateMismatch, chat_ids, message_delta
from ...actors.engine import Sample, end_of_turn_token_id
from ...actors.rollout import PromptRequest, Rollout, SamplingSettings
from ...rewards.protocol import is_finite_number

__all__ = [
    "Environment",
    "Episode",
    "GenerateFn",
    "StepResult",
    "TemplateMismatch",
    "Turn",
    "chat_ids",
    "checked_messages",
    "finish_episodes",
    "message_delta",
    "run_episodes",
    "start_episodes",
    "to_rollout",
]

#: (prompts `[N][P_i]`, sampling with n = 1) → (one Sample per prompt, policy_version)
GenerateFn = Callable[[list[list[int]], SamplingSettings], tuple[list[Sample], int]]


@dataclass
class StepResult:
    """An environment's answer to one model turn (environment → controller).

    Attributes:
        messages: new chat messages (`[{"role", "content"}]`), e.g. tool results.
        reward: a reward for this step, or None; an episode's rewards are summed.
        done: the episode ends (no messages are appended then).
        tool_calls, tool_errors: calls made and calls that failed (malformed, unknown
            tool, non-zero exit, timeout).
        tool_time_s: seconds spent running tools.
    """

    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_time_s: float = 0.0


class Environment(Protocol):
    """One episode's environment. `reset` gives the first messages for the data item;
    `step` answers each model turn (its text, special tokens removed)."""

    def reset(self, request: PromptRequest) -> list[dict[str, str]]: ...

    def step(self, message: str) -> StepResult: ...


@dataclass
class Turn:
    """One segment of a trajectory (shown per turn in the rollout files).

    Attributes:
        role: 'assistant' for a model turn, else the environment messages' role(s) joined
            by '+' (e.g. 'tool').
        ids: `[L]` token ids of the segment.
        mask: 1 for a model turn (trained on), 0 for environment tokens.
        logprobs: `[L]` the engine's logprobs for a model turn; None for environment.
        policy_version: version that sampled a model turn; None for environment.
        text: the model's text, or the environment messages' contents.
    """

    role: str
    ids: list[int]
    mask: int
    logprobs: list[float] | None = None
    policy_version: int | None = None
    text: str = ""


@dataclass
class Episode:
    """A trajectory being built: the prompt, its turns, and the conversation as messages."""

    uid: str
    request: PromptRequest
    env: Environment
    prompt_ids: list[int]
    messages: list[dict[str, str]]
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    env_reward: float | None = None
    stats: StepResult = field(default_factory=StepResult)
    error: str | None = None  # why this episode's sample fails (module docstring)
    components: dict[str, float] = field(default_factory=dict)  # finish()'s, by name

    @property
    def response_len(self) -> int:
        return sum(len(t.ids) for t in self.turns)

    @property
    def model_turns(self) -> int:
        return sum(t.mask for t in self.turns)


def start_episodes(
    tokenizer: Any,
    requests: list[PromptRequest],
    n: int,
    new_env: Callable[[str], Environment],
    max_prompt_tokens: int | None = None,
    limit_reason: str = "",
    threads: int = 4,
) -> list[Episode]:
    """`n` episodes per request (a group), each with its own environment (reset on
    `threads` threads); uid `{group_id}-{k}` as for single-turn rollouts.

    Args:
        max_prompt_tokens: the most tokens the first messages may come to (the engine's
            context minus the episode's token budget); an episode over it ends at once
            as a failed sample (module docstring) whose prompt is the request's own
            messages (cut to this length), so it never reaches the engine. None: no
            limit.
        limit_reason: how `max_prompt_tokens` was reached, for the error message.
    """
    slots = [(req, f"{req.group_id}-{k}") for req in requests for k in range(n)]
    envs = [new_env(uid) for _, uid in slots]
    with ThreadPoolExecutor(max_workers=threads) as pool:  # resets are network calls
        firsts = list(pool.map(_reset, envs, [req for req, _ in slots], [u for _, u in slots]))
    episodes = []
    for (req, uid), env, (messages, error) in zip(slots, envs, firsts, strict=True):
        ids = chat_ids(tokenizer, messages, True)
        e = Episode(uid, req, env, ids, messages, error=error)
        if error is None and max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            source = getattr(env, "source", type(env).__name__)
            e.error = (
                f"episode {uid}: {source} reset it to a prompt of {len(ids)} tokens, "
                f"over the {max_prompt_tokens} the engine takes ({limit_reason}); "
                "the episode was not run"
            )
            e.prompt_ids = chat_ids(tokenizer, req.messages, True)[:max_prompt_tokens]
            e.messages = list(req.messages)
        e.done = e.error is not None
        episodes.append(e)
    return episodes


def _reset(env: Environment, req: PromptRequest, uid: str) -> tuple[list[dict], str | None]:
    """The environment's first messages, or the request's own and the error when its
    `reset` raised or answered with the wrong types."""
    try:
        return checked_messages(env.reset(req), "reset"), None
    except Exception as exc:  # a user's environment: any failure is its episode's
        source = getattr(env, "source", type(env).__name__)
        return list(
            req.messages
        ), f"episode {uid}: {source} failed at reset: {type(exc).__name__}: {exc}"


def run_episodes(
    generate: GenerateFn,
    tokenizer: Any,
    episodes: list[Episode],
    sampling: SamplingSettings,
    max_turns: int,
    max_episode_tokens: int,
    threads: int = 4,
) -> list[Episode]:
    """Run every episode to its end (see the module docstring); returns `episodes`.

    Each turn samples one model turn for every running episode with one `generate` call
    per per-turn token limit (`min(max_new_tokens, tokens left)`), with seed
    `sampling.seed + 7919 * turn`.

    Raises:
        TemplateMismatch: see `message_delta`.
    """
    eot = end_of_turn_token_id(tokenizer)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for turn in range(max_turns):
            running = [e for e in episodes if not e.done]
            if not running:
                break
            by_limit: dict[int, list[Episode]] = {}
            for e in running:
                limit = min(sampling.max_new_tokens, max_episode_tokens - e.response_len)
                by_limit.setdefault(limit, []).append(e)
            for limit, group in by_limit.items():
                s = replace(sampling, n=1, max_new_tokens=limit, seed=sampling.seed + 7919 * turn)
                samples, version = generate([e.prompt_ids + _ids(e) for e in group], s)
                for e, sample in zip(group, samples, strict=True):
                    _add_model_turn(tokenizer, e, sample, version)
            stepping = [e for e in running if not e.done]
            results = list(pool.map(_step, stepping))
            for e, res in zip(stepping, results, strict=True):
                if res is not None:
                    _add_env_turn(tokenizer, e, res, eot, turn + 1 == max_turns, max_episode_tokens)
    return episodes


def checked_messages(got: Any, what: str) -> list[dict[str, str]]:
    """An environment's messages, checked: a list of `{"role": str, "content": str}`.

    Raises:
        TypeError: anything else, naming `what` and the first bad element.
    """
    if not isinstance(got, list | tuple):
        raise TypeError(f"{what} returned {type(got).__name__}, not a list of messages")
    for m in got:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise TypeError(
                f"{what} returned the message {m!r:.200}, not {{role: str, content: str}}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in got]


def _step(e: Episode) -> StepResult | None:
    """The environment's answer to the model's last turn; None (the episode ends, failed,
    its turns kept) when it raised or answered with the wrong types."""
    try:
        res = e.env.step(e.messages[-1]["content"])
        if not isinstance(res, StepResult):
            raise TypeError(f"step returned {type(res).__name__}, not a StepResult")
        res.messages = checked_messages(res.messages, "step")
        return res
    except Exception as exc:  # a user's environment: any failure is its episode's
        source = getattr(e.env, "source", type(e.env).__name__)
        e.error = e.error or (
            f"episode {e.uid}: {source} failed after model turn {e.model_turns}: "
            f"{type(exc).__name__}: {exc}"
        )
        e.done = True
        return None


def finish_episodes(episodes: list[Episode]) -> None:
    """Let environments with `finish(messages) -> (reward, {name: value})` score their
    ended episodes (a verifiers rubric): the reward is added as a step reward, the
    values become reward components; a failure fails that episode only."""
    for e in episodes:
        finish = getattr(e.env, "finish", None)
        if finish is None or e.error is not None:
            continue
        try:
            reward, e.components = finish(e.messages)
        except Exception as exc:  # a user's environment: any failure is its episode's
            source = getattr(e.env, "source", type(e.env).__name__)
            e.error = f"episode {e.uid}: {source} failed to score: {type(exc).__name__}: {exc}"
        else:
            _add_step_reward(e, reward)


def _ids(e: Episode) -> list[int]:
    return [i for t in e.turns for i in t.ids]


def _add_model_turn(tokenizer: Any, e: Episode, sample: Sample, version: int) -> None:
    text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    e.turns.append(
        Turn("assistant", list(sample.token_ids), 1, list(sample.logprobs), version, text)
    )
    e.messages.append({"role": "assistant", "content": text})
    if sample.finish_reason == "length":  # cut mid-turn: nothing sensible can follow
        e.done = e.truncated = True


def _add_env_turn(
    tokenizer: Any,
    e: Episode,
    res: StepResult,
    eot: int | None,
    last_turn: bool,
    max_episode_tokens: int,
) -> None:
    """Record the environment's answer; append its messages unless the episode ends."""
    st = e.stats
    st.tool_calls += res.tool_calls
    st.tool_errors += res.tool_errors
    st.tool_time_s += res.tool_time_s
    if res.reward is not None:
        _add_step_reward(e, res.reward)
    if res.done or not res.messages:
        e.done = True
        return
    if last_turn:  # the environment wanted another model turn
        e.done = e.truncated = True
        return
    delta = message_delta(tokenizer, e.messages, res.messages, e.turns[-1].ids[-1], eot)
    if e.response_len + len(delta) >= max_episode_tokens:
        e.done = e.truncated = True
        return
    e.turns.append(
        Turn(
            "+".join(m["role"] for m in res.messages),
            delta,
            0,
            text="\n".join(m["content"] for m in res.messages),
        )
    )
    e.messages.extend(res.messages)


def _add_step_reward(e: Episode, reward: Any) -> None:
    """Sum a step's reward into the episode, or set its `error` when the reward (or the
    sum) is not a finite number."""
    source = getattr(e.env, "source", type(e.env).__name__)
    if not is_finite_number(reward):
        e.error = e.error or (
            f"episode {e.uid}: {source} gave the step reward {reward!r} after model turn "
            f"{e.model_turns}; a reward must be a finite number"
        )
        return
    e.env_reward = (e.env_reward or 0.0) + reward
    if not is_finite_number(e.env_reward):
        e.error = e.error or (
            f"episode {e.uid}: the step rewards of {source} sum to {e.env_reward!r}"
        )


def to_rollout(e: Episode, prompt_text: str, policy_version: int = 0) -> Rollout:
    """The episode as a `Rollout`: `response_ids [R]` = every turn's ids after the prompt,
    `loss_mask [R]` (1 on model tokens), `inference_logprobs [R]` (the engine's on model
    tokens, 0.0 on environment tokens, where they mean nothing and `loss_mask` is 0),
    `finish_reason` 'length' for a truncated episode, `response_text` the model's last
    turn (what a verifier scores), `turns` for the rollout files. The environment's
    summed reward, when it gave one, is in `metadata['environment_reward']`; a failed
    episode's `error` in `metadata['episode_error']`. An episode that was never run has
    no response tokens and carries `policy_version` (the step's)."""
    ids = _ids(e)
    mask = [t.mask for t in e.turns for _ in t.ids]
    logprobs = [lp for t in e.turns for lp in (t.logprobs or [0.0] * len(t.ids))]
    versions = [t.policy_version for t in e.turns if t.policy_version is not None]
    metadata = dict(e.request.metadata)
    if e.env_reward is not None:
        metadata["environment_reward"] = e.env_reward
    if e.error is not None:
        metadata["episode_error"] = e.error
    if e.components:
        metadata["environment_components"] = dict(e.components)
    last = next((t.text for t in reversed(e.turns) if t.mask), "")
    return Rollout(
        uid=e.uid,
        group_id=e.request.group_id,
        prompt_ids=e.prompt_ids,
        response_ids=ids,
        inference_logprobs=logprobs,
        finish_reason="length" if e.truncated or not e.turns else "stop",
        policy_version=min(versions, default=policy_version),
        prompt_text=prompt_text,
        response_text=last,
        ground_truth=e.request.ground_truth,
        metadata=metadata,
        loss_mask=mask,
        turns=[asdict(t) for t in e.turns],
    )
