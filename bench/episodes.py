"""What an environment adapter costs per episode, side by side: the same guessing game
(examples/guess_env.py's rules) through each `rollout.environment` type.

    .venv/bin/python bench/episodes.py [--episodes 64] [--repeats 3] [--smoke]

Every episode is played to the end by a scripted engine that bisects [1, 100] from the
game's hints (no model: what is timed is the controller's side of an episode, the
environment calls and the token bookkeeping of multiturn.py), 7 or fewer turns. Rows:
the Python class (`type: python`), our HTTP protocol (`type: http`, the example served
in this process), an OpenEnv server over WebSocket (`type: openenv`,
examples/openenv_game.py in this process), and a verifiers MultiTurnEnv (`type:
verifiers`, through tests/stand_ins). Each row: seconds per episode (median of the
repeats) and the ratio to the HTTP row. `--smoke`: 4 episodes, one repeat, then the
`--vf1` table through the stand-in (tests/bench/).

    .venv/bin/python bench/episodes.py --vf1 [PYTHON] [--episodes 64] [--repeats 3]

`--vf1`: a single-call episode (examples/vf1_sums.py's sums, 8 samples per prompt, the
scripted engine answering the sum) three ways: our HTTP protocol (examples/guess_env.py
served here, its secret the sum: one model turn, one `/step`), a black-box agent program
(examples/openai_agent.py) and a verifiers 0.4 taskset (`type: verifiers, api: v1`,
recipes/episodes/vf1_driver.py), both through the agent step (agent_step.py) against a
rollout worker's OpenAI endpoint (actors/openai_server.py) on the scripted engine. PYTHON:
an interpreter with the real verifiers 0.4 (scripts/vf1_venv.sh); without it, the
stand-in (tests/stand_ins: its numbers say nothing about verifiers). Each row also gives
the CPU time per episode of this process and every program it waited for.
`--model smollm2-135m-instruct`: every path's model calls sampled by a rollout worker on
that model's vLLM engine instead (at most 16 tokens, as examples/vf1_sums.yaml; the
footnote counts the endpoint's engine calls by size); `--max-concurrent N`: verifiers'
episodes at once (`max_concurrent`, default 8).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests" / "stand_ins")]

import guess_env  # noqa: E402
import openenv_game  # noqa: E402
import verifiers as vf  # noqa: E402  (the stand-in: the real package cannot be installed here)
from _header import header  # noqa: E402  (bench/ is sys.path[0] when a bench runs)
from _smoke import SMOKE_HELP  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from posttrain.actors.engine import Sample  # noqa: E402
from posttrain.actors.rollout import PromptRequest, SamplingSettings  # noqa: E402
from posttrain.config.episodes import (  # noqa: E402
    HttpEnvironment,
    OpenEnvEnvironment,
    PythonEnvironment,
    VerifiersEnvironment,
)
from posttrain.recipes.episodes.environments import make_environment  # noqa: E402
from posttrain.recipes.episodes.multiturn import (  # noqa: E402
    finish_episodes,
    run_episodes,
    start_episodes,
)
from posttrain.recipes.episodes.openenv import episode_seed  # noqa: E402
from tests.hostile_servers import serve_app  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

_HINT = re.compile(r"(\d+) is wrong: go (higher|lower)")


class VfGuess(vf.MultiTurnEnv):
    """The guessing game as a verifiers environment (the secret is the row's answer)."""

    async def env_response(self, messages, state, **kwargs):
        out = guess_env.answer(int(state["answer"]), messages[-1]["content"])
        if out["done"]:  # verifiers' way to end the episode from env_response
            state["final_env_response"] = [{"role": "user", "content": "Right!"}]
            return state["final_env_response"]
        return out["messages"]


def won(state) -> float:
    """The rubric: 1 when the game was won."""
    return float(state.get("final_env_response") is not None)


def load_environment() -> VfGuess:
    """The module's verifiers entry point (`module: episodes`)."""
    return VfGuess(rubric=vf.Rubric(funcs=[won]))


class Bisect:
    """Guesses the middle of what the conversation's hints leave open."""

    def __init__(self, tok):
        self.tok, self.eot = tok, tok.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prompts, sampling):
        out = []
        for p in prompts:
            lo, hi = 1, 100
            for n, way in _HINT.findall(self.tok.decode(p)):
                lo, hi = (max(lo, int(n) + 1), hi) if way == "higher" else (lo, min(hi, int(n) - 1))
            ids = self.tok.encode(f"{(lo + hi) // 2}", add_special_tokens=False) + [self.eot]
            out.append(Sample(ids, [-0.1] * len(ids), "stop"))
        return out, 0


def play(tok, cfg, n: int) -> tuple[float, float]:
    """Seconds per episode and model turns per episode for `n` episodes of `cfg`."""
    groups = [f"b{i}" for i in range(n)]
    reqs = [
        PromptRequest(g, [{"role": "user", "content": "Guess."}], str(episode_seed(g) % 100 + 1))
        for g in groups
    ]
    t0 = time.perf_counter()
    eps = start_episodes(tok, reqs, 1, lambda uid: make_environment(cfg, f"{uid}@0"))
    run_episodes(Bisect(tok), tok, eps, SamplingSettings(n=1, max_new_tokens=8), 8, 400)
    finish_episodes(eps)
    for e in eps:
        getattr(e.env, "close", lambda: None)()
    took = time.perf_counter() - t0
    if any(e.error or e.env_reward != 1.0 for e in eps):
        bad = next(e for e in eps if e.error or e.env_reward != 1.0)
        raise RuntimeError(f"{cfg.type}: episode {bad.uid} did not win: {bad.error}")
    return took / n, statistics.fmean(e.model_turns for e in eps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument("--vf1", nargs="?", const="", default=None, metavar="PYTHON")
    ap.add_argument("--model", help="--vf1: sample on this model's vLLM engine (path or alias)")
    ap.add_argument("--max-concurrent", type=int, default=8, help="--vf1: verifiers' episodes")
    args = ap.parse_args()
    if args.smoke:
        args.episodes, args.repeats = 4, 1
    if args.vf1 is not None:
        from _episodes_vf1 import real_worker, single_call_table

        real, model = real_worker(args.model) if args.model else (None, build_model())
        tok = AutoTokenizer.from_pretrained(model)
        print(header())
        print(
            single_call_table(
                tok, model, args.vf1 or None, args.episodes, args.repeats, real, args.max_concurrent
            )
        )
        if real is not None:
            real.close()
        return
    model = build_model()
    tok = AutoTokenizer.from_pretrained(model)
    sys.modules.setdefault("episodes", sys.modules[__name__])
    rows = []
    with serve_app(guess_env.create_app()) as http, serve_app(openenv_game.create_app()) as oe:
        configs = {
            "python class": PythonEnvironment(type="python", class_path="guess_env:GuessingGame"),
            "http (ours)": HttpEnvironment(type="http", url=http, retries=0),
            "openenv, websocket": OpenEnvEnvironment(
                type="openenv", url=oe, observation_key="feedback", retries=0
            ),
            "verifiers": VerifiersEnvironment(type="verifiers", module="episodes"),
        }
        for name, cfg in configs.items():
            got = [play(tok, cfg, args.episodes) for _ in range(args.repeats)]
            rows.append((name, statistics.median(s for s, _ in got), got[0][1]))
    base = dict((n, s) for n, s, _ in rows)["http (ours)"]
    print(header())
    print("| environment | ms per episode (median) | turns per episode | vs http |")
    print("|---|---|---|---|")
    for name, s, turns in rows:
        print(f"| {name} | {1000 * s:.2f} | {turns:.2f} | {s / base:.2f}x |")
    print(f"({args.episodes} episodes at once, median of {args.repeats} runs; no model)")
    if args.smoke:  # the --vf1 mode too, through the stand-in
        from _episodes_vf1 import single_call_table

        print(single_call_table(tok, model, None, 8, 1))


def build_model() -> Path:
    return build_tiny_model(Path(_scratch()) / "m")


def _scratch() -> str:
    from _smoke import scratch

    return str(scratch())


if __name__ == "__main__":
    main()
