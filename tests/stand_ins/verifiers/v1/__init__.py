"""A minimal local stand-in for `verifiers.v1` (verifiers 0.4.0's only API), with the
public shape posttrain's driver (recipes/episodes/vf1_driver.py) and examples/vf1_sums.py
use, and little of its machinery: no interception server, no uv. Harnesses are plugins
as in verifiers (`load_harness`: the module `verifiers.v1.harnesses.<id>`, else `<id>`,
exporting its `Harness` subclass in `__all__`); its `null` harness (harnesses/null) runs
a chat program per episode through the runtime (runtimes.py) as the real one does, the
program making one streamed OpenAI chat call to the endpoint with the episode's headers
(the real one goes through verifiers' interception server, which relays to the same
endpoint with the same headers and answers the same way).

CI uses this because the real package cannot share posttrain's venv (it pins openai<3
and mcp==2.0.0) and its harness needs the network to prepare its program; the real
package runs in tests/recipes/test_vf1_real.py when $POSTTRAIN_VF1_PYTHON names an
interpreter that has it."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
from typing import Any, ClassVar, Generic, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field


def reward(func: Any = None, *, weight: float = 1.0, priority: int = 0) -> Any:
    """Marks an async task method `(trace) -> float` as a reward (`@vf.reward`)."""

    def mark(f: Any) -> Any:
        f.reward_priority, f._vf_weight = priority, weight
        return f

    return mark(func) if func is not None else mark


class TaskData(BaseModel):
    model_config = ConfigDict(frozen=True)
    idx: int | None = None
    prompt: str | list[Any] | None = None
    system_prompt: str | None = None


class TaskConfig(BaseModel):
    pass


class SubprocessConfig(BaseModel):
    type: str = "subprocess"


class HarnessConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = "bash"
    env: dict[str, str] = Field(default_factory=dict)

    @property
    def resolved_env(self) -> dict[str, str]:
        return dict(self.env)


class Reward(BaseModel):
    score: float
    weight: float = 1.0

    @property
    def value(self) -> float:
        return self.score * self.weight


class Error(BaseModel):
    type: str
    message: str


class Trace(BaseModel):
    last_reply: str = ""
    rewards: dict[str, Reward | None] = Field(default_factory=dict)
    errors: list[Error] = Field(default_factory=list)
    ok: bool = False


class Episode(BaseModel):
    ok: bool = False
    errors: list[Error] = Field(default_factory=list)
    traces: list[Trace] = Field(default_factory=list)


D = TypeVar("D")
T = TypeVar("T")
C = TypeVar("C")


class Task(Generic[D]):
    def __init__(self, data: Any, config: Any = None) -> None:
        self.data, self.config = data, config or TaskConfig()

    @property
    def key(self) -> str:
        return json.dumps(self.data.model_dump(mode="json", exclude_none=True), sort_keys=True)

    @classmethod
    def toolsets(cls, config: Any) -> list[Any]:
        return []

    async def score(self, trace: Trace) -> None:
        names = [n for n in dir(type(self)) if hasattr(getattr(type(self), n), "_vf_weight")]
        hooks = [getattr(self, n) for n in names]
        for fn in sorted(hooks, key=lambda f: (-f.reward_priority, f.__name__)):
            trace.rewards[fn.__name__] = Reward(score=float(await fn(trace)), weight=fn._vf_weight)


class TasksetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = ""
    task: TaskConfig = TaskConfig()


class Taskset(Generic[T, C]):
    INFINITE: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def bounded(self) -> bool:
        return not self.INFINITE

    def __iter__(self) -> Any:
        for i, t in enumerate(self.load()):
            yield t.__class__(t.data.model_copy(update={"idx": i}), t.config)

    @classmethod
    def _params(cls) -> tuple[Any, ...]:
        return next(get_args(b) for b in cls.__orig_bases__ if get_args(b))  # type: ignore[attr-defined]

    @classmethod
    def task_type(cls) -> type[Task]:
        return cls._params()[0]

    @classmethod
    def toolsets(cls, config: Any) -> list[Any]:
        return []


class Harness(Generic[C]):
    """A harness plugin's base: runs its program for an episode (`launch`)."""

    EXECUTES_CODE: ClassVar[bool] = True
    NEEDS_CONTAINER: ClassVar[bool] = True

    def __init__(self, config: HarnessConfig) -> None:
        self.config = config

    async def setup(self, runtime: Any) -> None:
        pass

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw) -> Any:
        raise NotImplementedError


def load_harness(config: HarnessConfig) -> Harness:
    name = config.id.replace("-", "_").lower()
    builtin = f"verifiers.v1.harnesses.{name}"
    module = importlib.import_module(builtin if importlib.util.find_spec(builtin) else name)
    cls = next(c for n in module.__all__ if issubclass(c := getattr(module, n), Harness))
    return cls(config)


class AgentConfig(BaseModel):
    harness: HarnessConfig | None = None
    runtime: SubprocessConfig = SubprocessConfig()


class EnvConfig(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    taskset: Any
    agent: AgentConfig = AgentConfig()
    timeout: dict[str, Any] = Field(default_factory=dict)

    def agent_harnesses(self) -> dict[str, HarnessConfig]:
        return {"agent": self.agent.harness or HarnessConfig(id="bash")}


class EvalClientConfig(BaseModel):
    base_url: str
    api_key_var: str = "PRIME_API_KEY"
    headers: dict[str, str] = Field(default_factory=dict)


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")


class ModelContext(BaseModel):
    model: str
    client: EvalClientConfig
    sampling: Sampling = Sampling()


def _taskset_class(taskset_id: str) -> type[Taskset]:
    module = importlib.import_module(taskset_id.replace("-", "_"))
    return next(c for n in module.__all__ if issubclass(c := getattr(module, n), Taskset))


class SingleAgentEnv:
    def __init__(self, config: EnvConfig) -> None:
        self.config, self.taskset = config, config.taskset

    @contextlib.asynccontextmanager
    async def serving(self) -> Any:
        yield

    async def run_episode(self, task: Task, ctx: ModelContext) -> Episode:
        """The agent's harness program on the task (one segment), then its rewards."""
        from .runtimes import SubprocessRuntime

        trace, runtime = Trace(), SubprocessRuntime()
        harness = load_harness(self.config.agent_harnesses()["agent"])
        try:
            await harness.setup(runtime)
            got = await harness.launch(
                ctx, trace, runtime, ctx.client.base_url, "stand-in", {}, task.data
            )
            if got.exit_code != 0:
                raise RuntimeError(f"harness exited {got.exit_code}: {got.stderr[-2000:]}")
            trace.last_reply = (runtime.workdir / "reply.txt").read_text()
            await task.score(trace)
        except Exception as e:  # noqa: BLE001 - as verifiers: an episode error is data
            trace.errors.append(Error(type=type(e).__name__, message=str(e)))
            return Episode(ok=False, errors=list(trace.errors), traces=[trace])
        finally:
            runtime.cleanup()
        trace.ok = True
        return Episode(ok=True, traces=[trace])


def environment_class(taskset_id: str, env_id: str = "") -> type:
    return getattr(importlib.import_module(taskset_id.replace("-", "_")), "Env", SingleAgentEnv)


def resolve_env_config(data: dict[str, Any]) -> EnvConfig:
    ts = dict(data["taskset"])
    cls = _taskset_class(ts["id"])
    taskset = cls(cls._params()[1].model_validate(ts))
    agent = AgentConfig.model_validate(data.get("agent") or {})
    return EnvConfig(taskset=taskset, agent=agent, timeout=data.get("timeout") or {})


def load_environment(config: EnvConfig) -> SingleAgentEnv:
    return SingleAgentEnv(config)
