"""Devices and nodes of a run: the check that `resources.device` can run here (at run
start, not at schema load, so a cluster recipe validates on a laptop), and the record of
where each learner rank landed (`RUN_DIR/cluster.json`, written by the controller).

What crosses nodes: every small file of a run (metrics, spans, rollouts, the manifest,
this record) is written by the controller from data the roles return. Two kinds of
file are written by the roles themselves and so need a filesystem every node shares at
the same path (NFS, Lustre, a cloud file store): learner checkpoints and the final
policy (`RUN_DIR/checkpoints`, `RUN_DIR/final`: DCP shards from every rank, the
`save_pretrained` folder from rank 0), and `weight_sync.type: filesystem`'s folder.
`check_shared_run_dir` refuses a run whose learner ranks cannot see the run folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import RecipeError, ResourcesConfig
from .placement import gpus_needed


def check_local_cuda(res: ResourcesConfig, rollout: bool = True) -> None:
    """On `device: cuda` with an embedded Ray cluster, this machine must have a CUDA
    build of torch and as many GPUs as the recipe places.

    Raises:
        RecipeError: names `resources.device` (and the GPU counts) and what to change.
    """
    if res.device != "cuda":
        return
    import torch

    need = gpus_needed(res, rollout)
    what = " with colocated engines" if res.colocate and rollout else ""
    if not torch.cuda.is_available():
        raise RecipeError(
            f"resources.device is 'cuda'{what}, but torch {torch.__version__} here sees no "
            "CUDA GPU; install a CUDA build of torch on a GPU machine (README, 'Installing on "
            "a GPU machine'), join a GPU cluster with --address, or set resources.device: cpu"
        )
    have = torch.cuda.device_count()
    if have < need:
        raise RecipeError(
            f"resources: the recipe places {need} GPUs but this machine has {have}; lower "
            "resources.rollout.gpus / resources.learner.gpus, set resources.colocate: true, "
            "or run on a cluster with --address"
        )


def learner_places(learners: list[Any]) -> list[dict[str, str]]:
    """Each learner rank's `rendezvous()` (node, GPUs, an address on its node), in rank
    order."""
    import ray

    return ray.get([lw.rendezvous.remote() for lw in learners])


def record_places(run_dir: Path, places: list[dict[str, str]], address: str) -> None:
    """Write `RUN_DIR/cluster.json`: the learner group's rendezvous address and each
    rank's node."""
    ranks = [
        {"rank": r, **{k: v for k, v in p.items() if k != "address"}} for r, p in enumerate(places)
    ]
    (run_dir / "cluster.json").write_text(
        json.dumps({"learner_group": address, "learner_ranks": ranks}, indent=1)
    )


def _exists(path: str) -> bool:
    return Path(path).exists()


def check_shared_run_dir(run_dir: Path, places: list[dict[str, str]]) -> None:
    """Learner ranks on another node write checkpoints into the run folder: it must be
    on a filesystem they share. A one-line Ray task on each learner node looks for
    `RUN_DIR/cluster.json` (written first by `record_places`).

    Raises:
        RecipeError: a node with learner ranks cannot see the run folder.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted({p["node_id"] for p in places if p["node_id"]})
    marker = str((run_dir / "cluster.json").resolve())
    check = ray.remote(num_cpus=0)(_exists)
    seen = ray.get(
        [
            check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
                marker
            )
            for n in nodes
        ]
    )
    blind = [n for n, ok in zip(nodes, seen, strict=True) if not ok]
    if blind:
        ips = sorted({p["node_ip"] for p in places if p["node_id"] in blind})
        raise RecipeError(
            f"learner ranks on nodes {ips} cannot see the run folder {run_dir.resolve()}, "
            "where they write checkpoints; put the run folder on a filesystem every node "
            "mounts at the same path (posttrain run --out), see README 'Running on a "
            "cluster'"
        )
