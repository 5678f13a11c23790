"""A rollout worker that dies in `__init__` fails the start at once, naming it: the
learner's set-up joins the push group with every engine, so without a watch it (and the
live engines) would wait `weight_sync.timeout_s` for the dead one."""

from __future__ import annotations

import time

import pytest
import ray

from posttrain.recipes.roles import get_watching


@ray.remote(num_cpus=0)
class _Worker:
    def __init__(self, fail: bool):
        time.sleep(1.0)
        if fail:
            raise RuntimeError("vLLM: not enough memory for the KV cache (2.0 GiB asked)")

    def ok(self) -> bool:
        return True


@ray.remote(num_cpus=0)
class _Learner:
    def setup(self, wait_s: float) -> str:
        time.sleep(wait_s)  # rank 0 waits in the push group for every engine
        return "ready"


def test_a_worker_dying_in_init_fails_the_learners_wait_at_once(ray_local):
    workers = [_Worker.remote(False), _Worker.remote(True)]
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"rollout worker 1 died while starting.*not enough memory"
    ):
        get_watching([_Learner.remote().setup.remote(120)], workers)
    assert time.monotonic() - t0 < 30  # not the 120 s the group would wait


def test_without_a_death_the_results_come_back_in_order(ray_local):
    workers = [_Worker.remote(False), _Worker.remote(False)]
    learners = [_Learner.remote(), _Learner.remote()]
    refs = [learners[0].setup.remote(2), learners[1].setup.remote(0)]
    assert get_watching(refs, workers) == ["ready", "ready"]
    assert ray.get(workers[1].ok.remote())
