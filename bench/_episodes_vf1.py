"""bench/episodes.py --vf1: one single-call episode (a sum, examples/vf1_sums.py) through
our HTTP protocol, a black-box agent program and a verifiers 0.4 taskset, side by side
(see bench/episodes.py's docstring). The engine is scripted (it answers the sum from the
prompt's text), so what is timed is everything around the model: the environment, the
agent step, the programs it starts, the endpoint's token bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

import guess_env  # noqa: E402  (bench/episodes.py put examples/ on sys.path)

from posttrain.actors.engine import Sample  # noqa: E402
from posttrain.actors.openai_server import EpisodeRecorder, create_app  # noqa: E402
from posttrain.actors.rollout import PromptRequest, SamplingSettings  # noqa: E402
from posttrain.config import Recipe  # noqa: E402
from posttrain.config.episodes import HttpEnvironment  # noqa: E402
from posttrain.recipes.data.environment import environment_items  # noqa: E402
from posttrain.recipes.episodes import vf1  # noqa: E402
from posttrain.recipes.episodes.agent_step import generate_agent_episodes  # noqa: E402
from posttrain.recipes.episodes.environments import make_environment  # noqa: E402
from posttrain.recipes.episodes.multiturn import (  # noqa: E402
    finish_episodes,
    run_episodes,
    start_episodes,
)
from tests.hostile_servers import serve_app  # noqa: E402

_SUM = re.compile(r"What is (\d+) \+ (\d+)\?")
SAMPLES = 8  # per prompt, as examples/vf1_sums.yaml
DRIVERS = vf1.Drivers()  # the verifiers v1 driver, kept up between steps as a run keeps it


def answer(tok: Any, ids: list[int]) -> Sample:
    """The scripted engine: the sum the prompt's last question asks, then end of turn."""
    a, b = _SUM.findall(tok.decode(ids))[-1]
    out = tok.encode(str(int(a) + int(b)), add_special_tokens=False)
    out.append(tok.convert_tokens_to_ids("<|im_end|>"))
    return Sample(out, [-0.1] * len(out), "stop")


class ScriptedWorker:
    """A rollout worker's `serve_openai` and `pop_episode` (actors/worker.py) over the
    scripted engine: the same endpoint app, recorder and routes."""

    def __init__(self, tok: Any, stack: contextlib.ExitStack) -> None:
        self.tok, self.stack, self.url = tok, stack, None
        self.recorder = EpisodeRecorder()

    def serve_openai(
        self, host: str, port: int, max_tokens: int, temperature: float, step: int = -1
    ) -> str:
        if self.url is None:
            gen = lambda ids, sampling: (answer(self.tok, ids), 0)  # noqa: E731
            app = create_app(gen, self.tok, self.recorder, max_tokens, temperature)
            self.url = self.stack.enter_context(serve_app(app)) + "/v1"
        return self.url

    def pop_episode(self, uid: str) -> dict | None:
        return self.recorder.pop(uid)


def _recipe(model: Path, rollout: dict[str, Any], prompts: int, tokens: int) -> Recipe:
    data = {"environment": "train"} if "environment" in rollout else {"generator": "arithmetic"}
    return Recipe.model_validate(
        {
            "name": "bench-vf1",
            "algorithm": "grpo",
            "model": {"path": str(model)},
            "data": {"train": data},
            "rollout": {
                "engine": "hf",
                "samples_per_prompt": SAMPLES,
                "max_new_tokens": tokens,
                "temperature": 1.0,
            }
            | rollout,
            "rewards": [{"name": "none", "type": "length", "target_chars": 1, "weight": 0.0}],
            "train": {"steps": 1, "prompts_per_step": prompts},
        }
    )


def _cpu() -> float:
    """CPU seconds of this process, of every child it has waited for, and of the
    verifiers drivers still up (with their own waited-for children: /proc/PID/stat)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    for driver in DRIVERS.running():
        fields = Path(f"/proc/{driver.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def _timed(fn: Any, n: int) -> tuple[float, float]:
    """(wall s, CPU s) per episode of `fn()` over `n` episodes."""
    t0, c0 = time.perf_counter(), _cpu()
    fn()
    return (time.perf_counter() - t0) / n, (_cpu() - c0) / n


def _http(
    tok: Any, url: str, reqs: list[PromptRequest], gen: Any, tokens: int, scripted: bool
) -> None:
    cfg = HttpEnvironment(type="http", url=url, retries=0)
    eps = start_episodes(tok, reqs, SAMPLES, lambda uid: make_environment(cfg, f"{uid}@0"))
    run_episodes(gen, tok, eps, SamplingSettings(n=1, max_new_tokens=tokens), 1, 400)
    finish_episodes(eps)
    for e in eps:
        getattr(e.env, "close", lambda: None)()
    # scripted: every episode wins; a real model: every episode ends without an error
    bad = [e for e in eps if e.error or (scripted and e.env_reward != 1.0)]
    if bad:
        raise RuntimeError(f"http: episode {bad[0].uid} did not win: {bad[0].error}")


def _agent(
    tok: Any, worker: Any, recipe: Recipe, reqs: list[PromptRequest], scripted: bool
) -> None:
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-vf1-") as folder:
        call = lambda w, verb, *a: getattr(w, verb)(*a)  # noqa: E731
        rollouts, _ = generate_agent_episodes(
            [worker], reqs, recipe, decode, Path(folder), 0, call, DRIVERS
        )
        log = (Path(folder) / "agent_00000.log").read_text()
    rewards = [r.metadata.get("environment_reward") for r in rollouts]
    # scripted: every episode wins; a real model: every episode is scored
    if not all(x is not None and (x >= 1.0 or not scripted) for x in rewards):
        raise RuntimeError(f"{recipe.rollout.environment}: not every episode won: {rewards}\n{log}")


def single_call_table(
    tok: Any,
    model: Path,
    python: str | None,
    episodes: int,
    repeats: int,
    real: Any = None,
    concurrent: int = 8,
) -> str:
    """The `--vf1` table: ms per episode (wall, median of `repeats`) and CPU ms per
    episode, through each path, `episodes` (rounded down to 8 per prompt) at once; each
    path's first step untimed (connections; the verifiers driver's start, which then
    stays up: the footnote gives each first step's seconds).

    `real`: a RolloutWorker on a real model (`--model`) samples every path's model calls
    (16 tokens at most, as examples/vf1_sums.yaml) instead of the scripted engine;
    `concurrent`: the verifiers driver's `max_concurrent`."""
    paths = [str(ROOT / "examples")] + ([] if python else [str(ROOT / "tests" / "stand_ins")])
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    prompts = max(1, episodes // SAMPLES)
    n, tokens = prompts * SAMPLES, 8 if real is None else 16
    v1 = {"type": "verifiers", "api": "v1", "module": "vf1_sums", "harness": {"id": "null"}}
    v1 |= {"python": python or sys.executable, "args": {"num_tasks": prompts}, "timeout_s": 600}
    v1 |= {"max_concurrent": concurrent}
    recipe = _recipe(model, {"environment": v1}, prompts, tokens)
    items = environment_items(recipe.rollout.environment, "train", "data.train", prompts, None)
    reqs = [PromptRequest(f"s0-p{i.prompt_id}", i.messages, "", i.metadata) for i in items]
    sums = [sum(map(int, _SUM.findall(i.question)[0])) for i in items]
    with_sums = [
        PromptRequest(r.group_id, r.messages, str(s)) for r, s in zip(reqs, sums, strict=True)
    ]
    agent = {"agent": {"command": [sys.executable, str(ROOT / "examples" / "openai_agent.py")]}}
    agent_recipe = _recipe(model, agent, prompts, tokens)
    rows = []
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(serve_app(guess_env.create_app()))
        if real is None:
            worker = ScriptedWorker(tok, stack)
            gen = lambda prompts, s: ([answer(tok, p) for p in prompts], 0)  # noqa: E731
        else:
            worker = real
            gen = lambda prompts, s: real.generate_ids(prompts, s, 0)  # noqa: E731
        scripted = real is None
        runs = {
            "http (ours)": lambda: _http(tok, url, with_sums, gen, tokens, scripted),
            "agent program (ours)": lambda: _agent(tok, worker, agent_recipe, with_sums, scripted),
            "verifiers v1" + ("" if python else " (stand-in)"): lambda: _agent(
                tok, worker, recipe, reqs, scripted
            ),
        }
        # untimed step: connections, the v1 driver's start
        first = {name: _timed(fn, n)[0] * n for name, fn in runs.items()}
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for _ in range(repeats):  # the paths in turn: a load that comes and goes hits each
            for name, fn in runs.items():
                got[name].append(_timed(fn, n))
        for name, g in got.items():
            wall, cpu = statistics.median(w for w, _ in g), statistics.median(c for _, c in g)
            rows.append((name, wall, cpu))
        DRIVERS.stop()
    return _table(rows, n, prompts, repeats, first, real, concurrent)


def _table(
    rows: list, n: int, prompts: int, repeats: int, first: dict, real: Any, concurrent: int
) -> str:
    base = rows[0][1]
    out = [
        "| path (one model call an episode) | ms per episode (median) | CPU ms per episode "
        "| vs http |"
    ]
    out.append("|---|---|---|---|")
    out += [
        f"| {name} | {1000 * w:.1f} | {1000 * c:.1f} | {w / base:.2f}x |" for name, w, c in rows
    ]
    model = "no model" if real is None else "the real model's engine, 16 tokens at most"
    batches = "" if real is None else f"; endpoint engine calls' sizes: {_sizes(real)}"
    out.append(
        f"({n} episodes at once ({prompts} prompts x {SAMPLES}; verifiers "
        f"max_concurrent {concurrent}), median of {repeats} steps after a first one, the "
        "paths in turn; "
        f"{model}{batches}. The first step's seconds: "
        + ", ".join(f"{k} {v:.2f}" for k, v in first.items())
        + ")"
    )
    return "\n".join(out)


def _sizes(worker: Any) -> str:
    """How many calls each endpoint engine call sampled: count per size."""
    counts: dict[int, int] = {}
    for b in worker.batcher.batches if worker.batcher else ():
        counts[b] = counts.get(b, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"


def real_worker(model: str) -> tuple[Any, Path]:
    """A rollout worker on `model` (a path or the alias) with the vLLM engine as
    examples/vf1_sums.yaml runs it (bfloat16, 2 threads), and the model's folder."""
    from posttrain.actors.engine import EngineSettings
    from posttrain.actors.worker import RolloutWorker
    from posttrain.common.model_registry import resolve_model_path

    path = resolve_model_path(model)
    return RolloutWorker(0, EngineSettings("vllm", str(path), "bfloat16"), "object_store", 2), path
