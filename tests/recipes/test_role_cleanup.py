"""Every role a run started is stopped on every exit path, also when `start_roles`
itself fails part-way: a learner group that fails to set up (a damaged checkpoint, out
of memory) must not leave the run's local reward service and its rollout workers
running. No Ray: the roles before the failing one are a real reward service process
and stand-in rollout actors."""

from __future__ import annotations

import time

import pytest
import ray

from posttrain.recipes import roles
from posttrain.recipes.algo import algorithm_for
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.placement import Placement
from posttrain.recipes.roles import handles as role_handles
from posttrain.recipes.roles import start as role_start
from tests.test_faults_e2e import _recipe


class _Call:
    def __init__(self, log: list[str], what: str):
        self.log, self.what = log, what

    def remote(self, *args):
        self.log.append(self.what)
        return f"ref-{self.what}"


class FakeActor:
    """A rollout worker handle: records `close.remote()`."""

    def __init__(self, log: list[str], name: str):
        self.name = name
        self.close = _Call(log, f"close {name}")


def test_learner_setup_failure_stops_the_roles_started_before(tiny_model, tmp_path, monkeypatch):
    recipe = load_recipe(_recipe(tmp_path, tiny_model))  # a local `length` reward, 2 engines
    procs, log = [], []
    start_service = role_handles.start_local_service

    def start_and_note(*args, **kwargs):
        procs.append(start_service(*args, **kwargs))
        return procs[-1]

    def learners_fail(*args, **kwargs):
        raise RuntimeError("learner rank 0: loading checkpoints/step_00004/learner failed")

    monkeypatch.setattr(role_handles, "start_local_service", start_and_note)
    monkeypatch.setattr(role_start, "place", lambda res, rollout: Placement([{}, {}], [{}]))
    monkeypatch.setattr(
        role_start,
        "start_rollout",
        lambda spec, placement: [FakeActor(log, "e0"), FakeActor(log, "e1")],
    )
    monkeypatch.setattr(role_start, "_launch_learners", learners_fail)
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (list(refs), []))
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: log.append(f"kill {actor.name}"))

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(RuntimeError, match="step_00004/learner failed"):
        roles.start_roles(recipe, algorithm_for(recipe), str(tiny_model), run_dir)

    assert len(procs) == 1
    deadline = time.time() + 15
    while procs[0].poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert procs[0].poll() is not None, "the reward service is still running"
    assert log == ["close e0", "close e1", "kill e0", "kill e1"]


def test_stop_roles_without_actors_starts_no_ray(monkeypatch):
    """A run that failed before any actor started: nothing to wait for (ray.wait of an
    empty list would start a local Ray cluster just to return)."""
    monkeypatch.setattr(ray, "wait", lambda *a, **k: pytest.fail("ray.wait called"))
    roles.stop_roles(roles.Roles(learners=[], placement=Placement()))
