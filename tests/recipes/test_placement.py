"""Placement on declared GPUs: each actor lands on the devices the recipe gives it."""

from __future__ import annotations

import pytest
import ray

from posttrain.config import RecipeError, ResourcesConfig
from posttrain.recipes.placement import check_cluster, gpus_needed, place, release


@ray.remote(num_cpus=0)
class Probe:
    def gpus(self) -> list[str]:
        import os

        ids = sorted(str(g) for g in ray.get_gpu_ids())
        # what a CUDA process in this actor would see
        visible = sorted(os.environ.get("CUDA_VISIBLE_DEVICES", "").split(","))
        assert visible == ids, (visible, ids)
        return ids


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=1, num_gpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _devices(opts: list[dict]) -> list[list[str]]:
    actors = [Probe.options(**o).remote() for o in opts]
    got = ray.get([a.gpus.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    return got


def _res(rollout: int, learner: int, colocate: bool = False) -> ResourcesConfig:
    return ResourcesConfig.model_validate(
        {"rollout": {"gpus": rollout}, "learner": {"gpus": learner}, "colocate": colocate}
    )


@pytest.mark.parametrize(("rollout", "learner"), [(6, 2), (2, 2)])
def test_split_places_disjoint_devices(cluster, rollout, learner):
    p = place(_res(rollout, learner))
    try:
        r, lrn = _devices(p.rollout), _devices(p.learner)
    finally:
        release(p)
    assert [len(d) for d in r] == [1] * rollout and [len(d) for d in lrn] == [1] * learner
    used_r = {g for d in r for g in d}
    used_l = {g for d in lrn for g in d}
    assert len(used_r) == rollout and len(used_l) == learner
    assert not used_r & used_l  # rollout and learner never share a device


def test_colocated_engine_and_rank_share_each_device(cluster):
    p = place(_res(2, 2, colocate=True))
    try:
        r, lrn = _devices(p.rollout), _devices(p.learner)
    finally:
        release(p)
    assert r == lrn and len({g for d in r for g in d}) == 2
    assert gpus_needed(_res(2, 2, colocate=True)) == 2


def test_too_few_gpus_named_before_anything_starts():
    with pytest.raises(
        RecipeError,
        match=r"needs 8 GPUs \(6 for rollout \+ 2 for the learner\)"
        r" but the Ray cluster has 4",
    ):
        check_cluster(_res(6, 2), 4)


def test_engine_split_must_divide():
    with pytest.raises(ValueError, match=r"rollout.gpus \(3\) is not divisible"):
        ResourcesConfig.model_validate({"rollout": {"gpus": 3, "gpus_per_engine": 2}})
