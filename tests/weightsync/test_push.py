"""`weightsync.push`, the order of one push, with stand-in actors: the learner side's
handle reaches every engine, late or wrong answers fail the push naming engine and
version, and the learners' side is waited for."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import ray

from posttrain.weightsync import WeightHandle, WeightSyncError, push


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Learner:
    def __init__(self, rank: int, delay_s: float = 0.0):
        self.rank, self.delay_s, self.finished = rank, delay_s, []

    def publish_weights(self, version: int, full: bool = False, fresh: bool = False):
        time.sleep(self.delay_s)
        yield WeightHandle(version, None, 10) if self.rank == 0 else None
        self.finished.append(version)  # the sender's side ends after the engines load

    def done(self) -> list[int]:
        return self.finished


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self, answer_offset: int = 0, delay_s: float = 0.0):
        self.offset, self.delay_s = answer_offset, delay_s

    def update_weights(self, handle: WeightHandle, step: int = -1) -> int:
        time.sleep(self.delay_s)
        if self.offset == "die":  # the engine's process ends inside the push
            os._exit(1)
        return handle.version + self.offset

    def policy_version(self) -> int:
        return 1


def test_push_reaches_every_engine_and_waits_for_the_learners(ray_local):
    learners = [Learner.remote(0), Learner.remote(1)]
    handle = push(learners, [Engine.remote(), Engine.remote()], 3, timeout_s=30)
    assert handle.version == 3 and handle.num_bytes == 10
    assert ray.get([lw.done.remote() for lw in learners]) == [[3], [3]]


def _started(*actors):
    """The actors, once their processes run (start-up is not what is timed here)."""
    ray.get([a.__ray_ready__.remote() for a in actors])
    return list(actors)


def test_a_late_or_wrong_engine_fails_the_push_by_name(ray_local):
    # the late engine answers after 120 s, far past the 10 s the push allows
    learner, engines = (
        _started(Learner.remote(0)),
        _started(Engine.remote(), Engine.remote(delay_s=120)),
    )
    with pytest.raises(
        WeightSyncError,
        match=r"rollout engines \[1\] did not acknowledge "
        r"policy_version 2 within 10 s",
    ):
        push(learner, engines, 2, timeout_s=10)
    with pytest.raises(
        WeightSyncError, match="rollout engine 0 reports policy_version 1 after a push of 2"
    ):
        push(
            _started(Learner.remote(0)), _started(Engine.remote(answer_offset=-1)), 2, timeout_s=60
        )


def test_a_learner_that_never_publishes_fails_the_push(ray_local):
    learner = _started(Learner.remote(0, delay_s=120))
    with pytest.raises(WeightSyncError, match="learner rank 0 did not publish policy_version 4"):
        push(learner, _started(Engine.remote()), 4, timeout_s=10)


def test_an_engine_that_dies_in_the_push_fails_it_by_name(ray_local):
    """A dead engine is a failed push (WeightSyncError naming it), which the loop ends
    with a checkpoint and the resume command (PushFailed), not Ray's ActorDiedError;
    what each engine still serves reports the dead one as None."""
    from posttrain.recipes.controller import served_versions

    engines = _started(Engine.remote(), Engine.remote(answer_offset="die"))
    with pytest.raises(
        WeightSyncError, match="rollout engine 1 died during the push of policy_version 2"
    ):
        push(_started(Learner.remote(0)), engines, 2, timeout_s=30)
    assert served_versions(SimpleNamespace(rollout=engines)) == [1, None]
