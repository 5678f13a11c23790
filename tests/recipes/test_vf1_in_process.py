"""The verifiers 0.4 driver's in-process chat program (recipes/episodes/vf1_driver.py,
`_run_chat_program`): verifiers' program text run in the driver's process answers as
the program would, an exit status and its traceback, on the argv it was given."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

DRIVER = Path(__file__).resolve().parents[2] / "recipes" / "episodes" / "vf1_driver.py"

PROGRAM = """
import argparse
from pathlib import Path


class AsyncOpenAI:
    closed = []

    async def close(self):
        AsyncOpenAI.closed.append(self)

def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-messages-file", default="")
    parser.add_argument("--then", default="ok")
    return parser.parse_args()

async def main():
    args = parse_args()
    client = AsyncOpenAI()  # never closed by the program: its exit does
    if args.then == "transport":
        raise SystemExit(97)
    if args.then == "raise":
        raise KeyError("choices")
    Path(args.initial_messages_file).write_text("seen")
"""


def _driver():
    spec = importlib.util.spec_from_file_location("vf1_driver_under_test", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _program() -> dict:
    scope: dict = {"__name__": "vf_chat_program"}
    exec(compile(PROGRAM, "<test program>", "exec"), scope)  # noqa: S102
    return scope


def test_the_program_runs_on_its_argv_in_its_directory(tmp_path):
    argv = sys.argv[:]
    got = asyncio.run(
        _driver()._run_chat_program(_program(), ["--initial-messages-file=m.json"], tmp_path)
    )
    assert got == (0, "")
    assert (tmp_path / "m.json").read_text() == "seen"  # relative to the program's directory
    assert sys.argv == argv


def test_its_exits_are_the_programs_exit_statuses(tmp_path):
    run = _driver()._run_chat_program
    code, err = asyncio.run(run(_program(), ["--then=transport"], tmp_path))
    assert code == 97 and "SystemExit: 97" in err
    code, err = asyncio.run(run(_program(), ["--then=raise"], tmp_path))
    assert code == 1 and "KeyError: 'choices'" in err
    code, err = asyncio.run(run(_program(), ["--nonsense"], tmp_path))
    assert code == 2 and "--nonsense" in err


def test_the_clients_it_opened_are_closed_after_it(tmp_path):
    program = _program()
    run = _driver()._run_chat_program
    asyncio.run(run(program, ["--initial-messages-file=m.json"], tmp_path))
    asyncio.run(run(program, ["--then=raise"], tmp_path))
    assert len(program["AsyncOpenAI"].closed) == 2


def test_every_episode_of_a_worker_shares_one_client_config(monkeypatch):
    """verifiers' interception server keeps one relay client per distinct client config:
    the episode id rides in each call's body (`episode_id`, read by the endpoint like
    the X-Episode-Id header), not in a per-episode header that made a client per episode."""
    monkeypatch.syspath_prepend(str(DRIVER.parents[2] / "tests" / "stand_ins"))
    driver = _driver()
    base = "http://127.0.0.1:9/v1"
    a = driver.model_context({"episode_id": "s0-p0-0", "base_url": base})
    b = driver.model_context({"episode_id": "s0-p0-1", "base_url": base})
    assert a.client.model_dump_json() == b.client.model_dump_json()
    assert a.client.base_url == base and not a.client.headers
    assert a.sampling.model_dump(exclude_none=True) == {"episode_id": "s0-p0-0"}
    assert b.sampling.model_dump(exclude_none=True) == {"episode_id": "s0-p0-1"}
