"""Runs a verifiers 0.4 (`verifiers.v1`) environment for posttrain, in the interpreter
that has verifiers (`rollout.environment.python`). Standalone: it imports the standard
library and `verifiers.v1` only, never posttrain (verifiers 0.4 pins openai<3 and
mcp==2.0.0, which posttrain's venv does not have).

    python vf1_driver.py check CONFIG   facts posttrain validates, as one JSON line
    python vf1_driver.py tasks CONFIG   the taskset's tasks, one JSON line each
    python vf1_driver.py serve CONFIG   step after step: each line on standard input
                                        ({"episodes": FILE, "log": FILE}) runs FILE's
                                        episodes, messages to that log, then prints
                                        `DONE`; ends when standard input closes

CONFIG is JSON: `taskset` (id), `args` (taskset config fields), `harness` (the seat's
harness config), `timeout_s` (per episode), `max_concurrent`, `limit`.

`serve` reads each episode file posttrain's agent step writes (recipes/episodes/agent_step.py:
`episode_id`, `base_url`, `metadata.vf1 = {idx, key}`), and per episode runs the
environment's own `run_episode(task, ctx)` with `ctx.client` an `EvalClientConfig` on
that `base_url` and the episode id in every call's body (`model_context`), so every
model call of the harness is sampled and recorded token-exactly by a rollout worker.
It then posts the episode's score to `{base_url}/episodes/{episode_id}/reward`: the
trace's weighted reward sum, each `@vf.reward` score a component; or `{"error": ...}`
when the episode failed (verifiers recorded an error, or a reward did not run). Exit 2
with a message on stderr: the configuration cannot run here.

The `null` harness's chat program runs in this process (`IN_PROCESS`, see
`in_process_null`): verifiers' own program text, executed once here and its `main()` run
per episode behind the same interception server, instead of a uv-prepared interpreter
started per episode (about 1 s of CPU each, importing openai).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
import traceback
import types
import urllib.request
from typing import Any

REFUSED = 2
#: The line `serve` prints when a step's episodes are done (recipes/episodes/vf1.py).
DONE = "posttrain-vf1: done"
#: The harness id `null` runs as: verifiers' null harness, its chat program in process.
IN_PROCESS = "posttrain_in_process_null"
# Run as a script, its own folder (which holds posttrain's verifiers.py) would shadow
# the verifiers package.
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != HERE]


class Refusal(Exception):
    """The environment needs what posttrain cannot give; the message says what."""


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        version = _installed_version()
        raise Refusal(
            f"{sys.executable} has verifiers {version}, without verifiers.v1 (verifiers "
            f">= 0.4): install verifiers>=0.4 there or set rollout.environment.python to "
            f"an interpreter that has it ({e})"
        ) from e
    return vf


def _installed_version() -> str:
    try:
        from importlib.metadata import version

        return version("verifiers")
    except Exception:  # noqa: BLE001 - any lookup failure means "not installed"
        return "(not installed)"


def load(cfg: dict[str, Any]) -> Any:
    """The environment of `cfg` with its one agent seat on the local subprocess runtime
    (the harness must reach the workers' 127.0.0.1 endpoints)."""
    vf = _vf()
    agent: dict[str, Any] = {"runtime": {"type": "subprocess"}}
    if cfg.get("harness"):
        agent["harness"] = dict(cfg["harness"])
        if agent["harness"].get("id") == "null":
            in_process_null()
            agent["harness"]["id"] = IN_PROCESS
    env_cls = vf.environment_class(cfg["taskset"])
    if not issubclass(env_cls, vf.SingleAgentEnv):
        raise Refusal(
            f"taskset {cfg['taskset']}: its environment {env_cls.__name__} is not a "
            "SingleAgentEnv; posttrain trains one policy on one agent seat per episode "
            "(multi-agent environments are not supported)"
        )
    data = {"taskset": {"id": cfg["taskset"], **cfg.get("args", {})}, "agent": agent}
    data["timeout"] = {"episode": cfg.get("timeout_s")}
    return vf.load_environment(vf.resolve_env_config(data))


def in_process_null() -> None:
    """Register harness `IN_PROCESS` (a verifiers harness plugin: a module exporting its
    `Harness` subclass in `__all__`): verifiers' `NullHarness`, whose chat program runs
    in this process.

    Its `launch` is verifiers' own (`launch_chat_program`: the same argv, the same
    interception endpoint and secret) on a view of the episode's runtime that runs that
    program's `main()` here instead of starting a uv-prepared interpreter; what the
    program would not see the same way here (another program, an environment of its
    own) still starts as a program. An exit the program would make (its transport-error
    code 97, an exception) is returned as that `ProgramResult`, so verifiers judges the
    run the same way.
    """
    if IN_PROCESS in sys.modules:
        return
    from verifiers.v1.harnesses.null import NullHarness
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes import ProgramResult

    program: dict[str, Any] = {"__name__": "vf_chat_program"}  # not __main__: no entry
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), program)  # noqa: S102
    if "certifi" in program:
        # Its client trusts certifi's CA file, which httpx loads into a new TLS context
        # per client (~20 ms of CPU); the same context, loaded once, serves every run.
        trust = ssl.create_default_context(cafile=program["certifi"].where())
        program["certifi"] = types.SimpleNamespace(where=lambda: trust)

    class InProcessRuntime:
        """The episode's runtime, but the chat program's argv runs in this process."""

        def __init__(self, runtime: Any) -> None:
            self._runtime = runtime

        def __getattr__(self, name: str) -> Any:
            return getattr(self._runtime, name)

        async def prepare_uv_script(self, source: Any, env: Any = None, **kw: Any) -> list[str]:
            same_env = all(os.environ.get(k) == v for k, v in (env or {}).items())
            alone = not self._runtime.env and self._runtime.user is None
            if source == CHAT_PROGRAM_SOURCE and same_env and alone:
                return [IN_PROCESS]
            return await self._runtime.prepare_uv_script(source, env, **kw)

        async def run_program(self, argv: list[str], env: dict[str, str]) -> Any:
            if argv[:1] != [IN_PROCESS]:
                return await self._runtime.run_program(argv, env)
            code, err = await _run_chat_program(program, argv[1:], self._runtime.workdir)
            return ProgramResult(exit_code=code, stdout="", stderr=err)

    class InProcessNullHarness(NullHarness):
        """verifiers' null harness, its chat program run in the driver's process."""

        async def setup(self, runtime: Any) -> None:
            """Nothing to prepare: no uv program (one is prepared if `launch` needs it)."""

        async def launch(self, ctx: Any, trace: Any, runtime: Any, *args: Any, **kw: Any) -> Any:
            return await super().launch(ctx, trace, InProcessRuntime(runtime), *args, **kw)

    module = types.ModuleType(IN_PROCESS, InProcessNullHarness.__doc__)
    module.InProcessNullHarness = InProcessNullHarness  # type: ignore[attr-defined]
    module.__all__ = ["InProcessNullHarness"]  # type: ignore[attr-defined]
    sys.modules[IN_PROCESS] = module


async def _run_chat_program(program: dict[str, Any], argv: list[str], cwd: Any) -> tuple[int, str]:
    """Run the chat program's `main()` on `argv` here: (its exit status, its traceback).

    Its `parse_args` reads `sys.argv` (set around that synchronous call only); a relative
    file argument is resolved against `cwd`, the directory the program would run in."""
    saved = sys.argv
    sys.argv = ["vf-chat-program", *argv]
    try:
        args = program["parse_args"]()
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 2), f"bad arguments: {argv}"
    finally:
        sys.argv = saved
    if args.initial_messages_file and not os.path.isabs(args.initial_messages_file):
        args.initial_messages_file = os.path.join(str(cwd), args.initial_messages_file)
    scope = {**program, "parse_args": lambda: args}  # main's globals, this run's argv
    clients: list[Any] = []  # closed after the run, as the program's exit closes them
    if "AsyncOpenAI" in program:

        def opened(*a: Any, **kw: Any) -> Any:
            clients.append(program["AsyncOpenAI"](*a, **kw))
            return clients[-1]

        scope["AsyncOpenAI"] = opened
    main = types.FunctionType(program["main"].__code__, scope, "main")
    try:
        await main()
    except SystemExit as e:  # the program's own exit (97: the model transport failed)
        return (e.code if isinstance(e.code, int) else 1), traceback.format_exc()
    except Exception:  # noqa: BLE001 - the program would exit 1 with this traceback
        return 1, traceback.format_exc()
    finally:
        for client in clients:
            await client.close()
    return 0, ""


def check(env: Any) -> dict[str, Any]:
    """Facts about `env`, refusing what posttrain's endpoint cannot serve exactly.

    Raises:
        Refusal: tools (the endpoint does not render the OpenAI `tools` field), a
            harness that hands the model code execution or needs a container, a
            runtime other than the local subprocess.
    """
    vf = _vf()
    taskset = env.taskset
    tools = [type(t).__name__ for t in type(taskset).toolsets(taskset.config)]
    tools += [type(t).__name__ for t in type(taskset).task_type().toolsets(taskset.config.task)]
    if tools:
        raise Refusal(
            f"taskset {taskset.config.id}: toolsets {tools} give the model native tool "
            "calls (the OpenAI `tools` field), which posttrain's endpoint does not render; "
            "posttrain runs tool-less v1 tasksets (tools as text in the conversation)"
        )
    for seat, hcfg in env.config.agent_harnesses().items():
        harness = vf.load_harness(hcfg)
        if harness.EXECUTES_CODE or harness.NEEDS_CONTAINER:
            raise Refusal(
                f"harness {hcfg.id!r} (seat {seat}) gives the model tools or needs a "
                "container; posttrain's endpoint serves tool-less chat: set "
                "rollout.environment.harness: {id: 'null'} (verifiers' chat loop)"
            )
    runtime = env.config.agent.runtime
    if not isinstance(runtime, vf.SubprocessConfig):
        raise Refusal(f"runtime {type(runtime).__name__}: posttrain needs the local subprocess")
    harness = env.config.agent_harnesses()["agent"].id
    return {"env": type(env).__name__, "harness": "null" if harness == IN_PROCESS else harness}


def tasks(env: Any, limit: int | None) -> list[dict[str, Any]]:
    """The first `limit` tasks: `idx`, `key`, `prompt` (text or messages), `system_prompt`.

    Raises:
        Refusal: an infinite taskset without a limit.
    """
    if limit is None and not env.taskset.bounded:
        raise Refusal(
            f"taskset {env.taskset.config.id} is infinite: give data.train a limit "
            "({environment: train, limit: N})"
        )
    out = []
    for task in env.taskset:
        if limit is not None and len(out) >= limit:
            break
        d = task.data
        prompt = d.prompt
        if not isinstance(prompt, str | None):
            prompt = [m.model_dump(mode="json", exclude_none=True) for m in prompt]
        out.append(
            {"idx": d.idx, "key": task.key, "prompt": prompt, "system_prompt": d.system_prompt}
        )
    return out


def _tasks_by_idx(env: Any, wanted: dict[int, str]) -> dict[int, Any]:
    """The tasks at the `wanted` positions, each checked against the key it had when
    posttrain read the prompts."""
    found: dict[int, Any] = {}
    for task in env.taskset:
        if task.data.idx in wanted:
            if task.key != wanted[task.data.idx]:
                raise Refusal(f"task {task.data.idx} changed since its prompt was read")
            found[task.data.idx] = task
        if len(found) == len(wanted):
            break
    return found


def score(episode: Any) -> dict[str, Any]:
    """The reward body for a finished episode (see the module docstring)."""
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not episode.ok or errors:
        why = "; ".join(f"{e.type}: {e.message}" for e in errors) or "not ok"
        return {"error": f"verifiers episode failed: {why}"[:4000]}
    total, parts = 0.0, {}
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            if reward is None:
                return {"error": f"reward {name} did not run"}
            parts[name] = reward.score
            total += reward.value
    return {"reward": total, "components": parts}


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - the workers' URL
        r.read()


def model_context(line: dict[str, Any]) -> Any:
    """The harness's model for the episode of `line`: its worker's endpoint, the episode
    id in the body of every call (`episode_id`, which the endpoint reads as it reads the
    `X-Episode-Id` header; verifiers imposes `Sampling`'s extra keys on each relayed
    request). The client config is then the same for every episode of a worker, so
    verifiers' interception server relays them all through one client (a header per
    episode made a client, and its TLS context, per episode)."""
    vf = _vf()
    client = vf.EvalClientConfig(base_url=line["base_url"], api_key_var="POSTTRAIN_VF1_KEY")
    sampling = vf.Sampling(episode_id=line["episode_id"])
    return vf.ModelContext(model="policy", client=client, sampling=sampling)


async def _one(env: Any, task: Any, line: dict[str, Any], gate: asyncio.Semaphore) -> None:
    eid, base, ctx = line["episode_id"], line["base_url"], model_context(line)
    async with gate:
        try:
            body = score(await env.run_episode(task, ctx))
        except Exception as e:  # noqa: BLE001 - one episode fails, named; the rest go on
            body = {"error": f"verifiers raised {type(e).__name__}: {e}"[:4000]}
    try:
        await asyncio.to_thread(_post, f"{base}/episodes/{eid}/reward", body)
    except Exception as e:  # noqa: BLE001 - e.g. no call was made: posttrain names it
        print(f"episode {eid}: reward not posted: {e}", file=sys.stderr)


async def run(env: Any, cfg: dict[str, Any], lines: list[dict[str, Any]]) -> None:
    """Every episode of `lines`, at most `max_concurrent` at once, inside the
    environment's serving resources."""
    refs = [ln["metadata"]["vf1"] for ln in lines]
    found = _tasks_by_idx(env, {ref["idx"]: ref["key"] for ref in refs})
    gate = asyncio.Semaphore(int(cfg.get("max_concurrent", 8)))
    async with env.serving():
        await asyncio.gather(
            *(_one(env, found[ref["idx"]], ln, gate) for ref, ln in zip(refs, lines, strict=True))
        )


def _episodes(path: str) -> list[dict[str, Any]]:
    """The lines of an episode file (recipes/episodes/agent_step.py writes it)."""
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


async def serve(env: Any, cfg: dict[str, Any]) -> None:
    """The `serve` verb: steps until standard input closes (posttrain's process went)."""
    while line := await asyncio.to_thread(sys.stdin.readline):
        step = json.loads(line)
        sys.stderr.flush()
        fd = os.open(step["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)  # this step's messages (verifiers' logging included) to its log
        os.close(fd)
        await run(env, cfg, _episodes(step["episodes"]))
        print(DONE, flush=True)


def main(argv: list[str]) -> int:
    verb, cfg = argv[1], json.loads(argv[2])
    try:
        env = load(cfg)
        facts = check(env)
        if verb == "check":
            print(json.dumps(facts))
        elif verb == "tasks":
            for t in tasks(env, cfg.get("limit")):
                print(json.dumps(t))
        else:  # serve
            asyncio.run(serve(env, cfg))
    except Refusal as e:
        print(str(e), file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
