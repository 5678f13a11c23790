"""The verifiers 0.4 driver kept up between steps (recipes/episodes/vf1.py): one
driver process runs step after step (its seconds of imports and taskset loading paid
once), a step past `step_timeout_s` fails named and stops that driver, a driver gone
is replaced at the next step, a driver whose parent goes (standard input closed)
exits, and the drivers are a role of the run that `stop_roles` stops. Through the
stand-in of verifiers.v1 (tests/stand_ins)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.actors.rollout import PromptRequest
from posttrain.recipes.data.environment import environment_items
from posttrain.recipes.episodes import vf1
from posttrain.recipes.episodes.agent_step import AgentProgramFailed, generate_agent_episodes
from posttrain.recipes.placement import Placement
from posttrain.recipes.roles import Roles, stop_roles
from tests.recipes.test_vf1_env import _recipe

ROOT = Path(__file__).resolve().parents[2]

SLOW = """
import asyncio

import verifiers.v1 as vf
from vf1_sums import SumsConfig, SumsTask, SumsTaskset

__all__ = ["SlowTaskset"]


class SlowTask(SumsTask):
    @vf.reward(weight=1.0)
    async def correct(self, trace):
        await asyncio.sleep(60)
        return 1.0


class SlowTaskset(vf.Taskset[SlowTask, SumsConfig]):
    def load(self):
        return [SlowTask(t.data, t.config) for t in SumsTaskset(self.config).load()]
"""


@pytest.fixture(autouse=True)
def drivers(monkeypatch, tmp_path):
    """The run's drivers (a role), stopped after the test."""
    (tmp_path / "vf1_slow.py").write_text(SLOW)
    paths = [str(tmp_path), str(ROOT / "examples"), str(ROOT / "tests" / "stand_ins")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    held = vf1.Drivers()
    yield held
    held.stop()


def _step(worker, recipe, folder, step, drivers):
    w, _ = worker
    (item,) = environment_items(recipe.rollout.environment, "train", "data.train", 1, None)
    req = PromptRequest(f"s{step}-p0", item.messages, "", item.metadata)
    tok = w.engine.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    call = lambda w_, verb, *a: getattr(w_, verb)(*a)  # noqa: E731
    return generate_agent_episodes(
        [w], [req], recipe, decode, folder, step, call=call, drivers=drivers
    )


def test_one_driver_runs_step_after_step(hf_worker, tmp_path, drivers):
    recipe = _recipe(str(hf_worker[1]))
    rollouts, _ = _step(hf_worker, recipe, tmp_path, 0, drivers)
    (driver,) = drivers.running()
    pid = driver.proc.pid
    assert driver.proc.poll() is None  # up between steps
    rollouts += _step(hf_worker, recipe, tmp_path, 1, drivers)[0]
    assert [d.proc.pid for d in drivers.running()] == [pid]
    assert all("environment_reward" in r.metadata for r in rollouts) and len(rollouts) == 4
    driver.stop()  # gone (a crash): the next step starts another
    _step(hf_worker, recipe, tmp_path, 2, drivers)
    assert [d.proc.pid for d in drivers.running()] != [pid]


@pytest.fixture
def started(monkeypatch):
    """The WarmDrivers a test starts, in order."""
    made = []

    class Recorded(vf1.WarmDriver):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(vf1, "WarmDriver", Recorded)
    return made


def test_a_step_past_its_timeout_fails_named_and_stops_its_driver(
    hf_worker, tmp_path, drivers, started
):
    recipe = _recipe(str(hf_worker[1]), module="vf1_slow", step_timeout_s=2.0)
    with pytest.raises(AgentProgramFailed, match=r"step 0: the verifiers driver ran past its"):
        _step(hf_worker, recipe, tmp_path, 0, drivers)
    assert not drivers.running() and started[0].proc.poll() is not None  # stopped


def test_stop_roles_stops_the_runs_drivers(hf_worker, tmp_path):
    """The drivers are a role: the run's `stop_roles` (every exit) ends them."""
    roles = Roles(learners=[], placement=Placement())
    _step(hf_worker, _recipe(str(hf_worker[1])), tmp_path, 0, roles.vf1_drivers)
    (driver,) = roles.vf1_drivers.running()
    stop_roles(roles)
    assert driver.proc.poll() is not None and not roles.vf1_drivers.running()


def test_a_step_without_the_runs_drivers_stops_its_own(hf_worker, tmp_path, started):
    _step(hf_worker, _recipe(str(hf_worker[1])), tmp_path, 0, None)
    assert len(started) == 1 and started[0].proc.poll() is not None


def test_a_driver_whose_parent_went_exits(tmp_path):
    cfg = _recipe("m").rollout.environment
    driver = vf1.WarmDriver(vf1.driver_command(cfg, "serve"), tmp_path / "log")
    driver.proc.stdin.close()  # what this process's exit does to it
    assert driver.proc.wait(timeout=60) == 0, (tmp_path / "log").read_text()
