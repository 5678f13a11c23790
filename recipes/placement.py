"""Turn a recipe's `resources:` block into Ray placement groups.

Split (colocate: false): one placement group per rollout engine, holding its
`gpus_per_engine` GPUs together (STRICT_PACK: one engine never spans nodes), and one
for the learner group with one GPU bundle per rank (PACK). Colocated: one group of N
GPU bundles; rollout engine i and learner rank i share bundle i, half a GPU each, and
time-share the device (in synchronous mode they never compute at once).

On `device: cpu` the controller starts Ray with exactly as many declared GPUs as the
recipe needs, so this same code runs, and `ray.get_gpu_ids()` inside each actor tells
which declared device it got. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import RecipeError, ResourcesConfig


@dataclass
class Placement:
    """Ray actor options for every rollout engine and learner rank.

    Attributes:
        rollout: options per engine (`num_gpus`, `scheduling_strategy`).
        learner: options per learner rank.
        groups: the placement groups, to remove at shutdown.
    """

    rollout: list[dict[str, Any]] = field(default_factory=list)
    learner: list[dict[str, Any]] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)


def gpus_needed(res: ResourcesConfig, rollout: bool = True) -> int:
    """Declared devices the recipe occupies (`rollout=False`: learner only, as DPO)."""
    if not rollout:
        return res.learner.gpus
    if res.colocate and rollout:
        return max(res.rollout.gpus, res.learner.gpus)
    return res.rollout.gpus + res.learner.gpus


def check_cluster(res: ResourcesConfig, cluster_gpus: float, rollout: bool = True) -> None:
    """Raises RecipeError, naming the numbers, when the cluster has too few GPUs."""
    need = gpus_needed(res, rollout)
    if cluster_gpus < need:
        how = (
            "learner only"
            if not rollout
            else "colocated"
            if res.colocate
            else f"{res.rollout.gpus} for rollout + {res.learner.gpus} for the learner"
        )
        raise RecipeError(
            f"resources: the recipe needs {need} GPUs ({how}) but the Ray cluster has "
            f"{cluster_gpus:g}; lower resources.rollout.gpus / resources.learner.gpus, set "
            "resources.colocate: true, or add nodes"
        )


def place(res: ResourcesConfig, timeout_s: float = 60.0, rollout: bool = True) -> Placement:
    """Create the placement groups and return actor options; waits until scheduled.
    `rollout=False` places the learner group only (DPO).

    Raises:
        RecipeError: the cluster lacks the GPUs, or the groups cannot be scheduled
            within `timeout_s` (e.g. GPUs spread over nodes too thinly for one engine).
    """
    import ray

    check_cluster(res, ray.cluster_resources().get("GPU", 0.0), rollout)
    out = Placement()
    n_engines = res.rollout.engines if rollout else 0
    if res.colocate:
        _place_colocated(res, n_engines, out)
    else:
        _place_separate(res, n_engines, out)
    _wait_scheduled(out, timeout_s)
    return out


def _strategy(pg: Any, index: int) -> Any:
    """Ray's scheduling strategy for bundle `index` of placement group `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def _place_colocated(res: ResourcesConfig, n_engines: int, out: Placement) -> None:
    """One PACK group of `gpus_needed` GPUs; engine i and learner rank i share bundle i,
    half a GPU each."""
    from ray.util.placement_group import placement_group

    pg = placement_group([{"GPU": 1.0}] * gpus_needed(res), strategy="PACK")
    out.groups.append(pg)
    out.rollout = [
        {"num_gpus": 0.5, "scheduling_strategy": _strategy(pg, i)} for i in range(n_engines)
    ]
    out.learner = [
        {"num_gpus": 0.5, "scheduling_strategy": _strategy(pg, i)} for i in range(res.learner.gpus)
    ]


def _place_separate(res: ResourcesConfig, n_engines: int, out: Placement) -> None:
    """One STRICT_PACK group per engine (its `gpus_per_engine` GPUs on one node), then
    one PACK group for the learner ranks, one GPU each."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    for _ in range(n_engines):
        pg = placement_group([{"GPU": 1.0}] * res.rollout.gpus_per_engine, strategy="STRICT_PACK")
        out.groups.append(pg)
        if res.rollout.gpus_per_engine == 1:
            out.rollout.append({"num_gpus": 1, "scheduling_strategy": _strategy(pg, 0)})
        else:
            # Tensor parallel: vLLM's Ray executor puts one worker on each bundle of
            # the actor's group, so the actor itself holds no GPU.
            out.rollout.append(
                {
                    "num_gpus": 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_capture_child_tasks=True
                    ),
                }
            )
    pg = placement_group([{"GPU": 1.0}] * res.learner.gpus, strategy="PACK")
    out.groups.append(pg)
    out.learner = [
        {"num_gpus": 1, "scheduling_strategy": _strategy(pg, i)} for i in range(res.learner.gpus)
    ]


def _wait_scheduled(out: Placement, timeout_s: float) -> None:
    """Wait for every group of `out` to be scheduled.

    Raises:
        RecipeError: some are still pending after `timeout_s` (all groups released).
    """
    import ray

    ready, _ = ray.wait(
        [g.ready() for g in out.groups], num_returns=len(out.groups), timeout=timeout_s
    )
    if len(ready) < len(out.groups):
        release(out)
        raise RecipeError(
            f"resources: Ray could not schedule the placement groups within {timeout_s:.0f} s "
            f"({len(out.groups) - len(ready)} pending); check `ray status` for free GPUs"
        )


def release(placement: Placement) -> None:
    """Remove the placement groups (their actors must be gone or be killed with them)."""
    from ray.util.placement_group import remove_placement_group

    for pg in placement.groups:
        remove_placement_group(pg)
