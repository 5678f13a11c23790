"""Starting and stopping the roles of one run: the learner group, the rollout workers
and their push group, the reward service; the embedded Ray cluster and the run folder's
manifest. The named calls a step is made of are in recipes/controller.py; the settings
each role is started with, in recipes/roles/settings.py.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from ...actors.worker import RolloutWorker
from ...common.net import free_port
from ...common.process import cpu_allocator_env, default_threads, split_cores
from ...config import LOCAL_TYPES, Recipe, RecipeError
from ...rewards.client import RewardClient, RewardSet
from ...weightsync import GroupStore, TransportSettings, make_transport, push
from ..loading import dump_recipe
from ..placement import Placement, gpus_needed, place, release
from .env_server import start_environment_server
from .handles import LocalServiceLaunch, RelaunchSpecs, Roles
from .settings import (
    RolloutSpec,
    adapter_sync,
    learner_settings,
    rollout_concurrency,
    rollout_spec,
    transport_settings,
)

if TYPE_CHECKING:
    from ..algo.base import Algorithm


def start_roles(
    recipe: Recipe,
    algo: Algorithm,
    model_path: str,
    run_dir: Path,
    resume_from: str | None = None,
    adapter_slots: int = 1,
) -> Roles:
    """Start the learner group and, when the algorithm samples (`algo.uses_rollouts`),
    the environment server (`rollout.environment.serve`, waited for before anything
    else starts), the reward service, the rollout workers and their push group. `resume_from`: the
    learners' training state to load (a checkpoint's `learner/` folder). When one role
    fails to start, every role started before it is stopped (`stop_roles`) before the
    error is raised, so a failed start leaves no reward service or worker running.
    `adapter_slots`: named LoRA adapters each engine serves at once (`posttrain serve`'s
    sessions; a recipe's engines serve one).

    Raises:
        RecipeError: an adapter target that names no layer of the model.
        RuntimeError: a role failed to start (the message names it).
    """
    roles = Roles(learners=[], placement=place(recipe.resources, rollout=algo.uses_rollouts))
    try:
        _start_roles(roles, recipe, algo, model_path, run_dir, resume_from, adapter_slots)
    except BaseException:
        stop_roles(roles)
        raise
    return roles


def _start_roles(
    roles: Roles,
    recipe: Recipe,
    algo: Algorithm,
    model_path: str,
    run_dir: Path,
    resume_from: str | None,
    adapter_slots: int = 1,
) -> None:
    """`start_roles` into `roles` (each handle set as soon as its role runs)."""
    res = recipe.resources
    placement = roles.placement
    n_rollout, n_learn = len(placement.rollout), len(placement.learner)
    # Synchronous mode: the rollout side and the learner side never compute at once,
    # so each side gets all cores, split among its own workers.
    threads_r = res.threads_per_worker or default_threads(max(n_rollout, 1))
    threads_l = res.threads_per_worker or default_threads(n_learn)
    if recipe.train.max_staleness and res.threads_per_worker is None:
        # Asynchronous mode: both sides compute at once, so they split the cores.
        threads_r, threads_l = split_cores(n_rollout, n_learn, res.rollout_cores)
    transport = transport_settings(recipe, run_dir)
    reward_launch = worker_spec = None
    if algo.uses_rollouts:  # the environment server first: a bad one fails in seconds
        start_environment_server(roles, recipe, run_dir)
        roles.reward, reward_launch = start_rewards(recipe, run_dir)
        roles.reward_proc = reward_launch.start() if reward_launch else None
        if make_transport(transport.type).needs_group:
            roles.group = GroupStore(n_rollout + 1, recipe.weight_sync.timeout_s)
            transport = replace(
                transport, group_address=roles.group.address, group_world=roles.group.world_size
            )
        worker_spec = rollout_spec(recipe, model_path, threads_r, transport)
        if adapter_slots > 1:
            worker_spec.engine = replace(worker_spec.engine, max_adapters=adapter_slots)
        roles.rollout = start_rollout(worker_spec, placement)
    roles.specs = RelaunchSpecs(
        reward=reward_launch,
        rollout=worker_spec,
        learners=partial(
            _launch_learners, recipe, algo, model_path, placement, threads_l, run_dir=run_dir
        ),
        transport=transport,
    )
    # A rollout worker that dies in its __init__ never joins the push group: the
    # learner's set-up (which joins it) fails at once naming it, not after timeout_s.
    roles.learners = roles.specs.learners(transport, resume_from, watch=roles.rollout)
    if roles.rollout:
        ray.get([w.health.remote() for w in roles.rollout])
    if adapter_sync(recipe) and recipe.model.adapter.type == "qlora":
        # Engines serve base + adapter; their base must be the learner's NF4 base
        # dequantised, not the checkpoint: send it once, as policy_version 0.
        push(roles.learners, roles.rollout, 0, recipe.weight_sync.timeout_s, full=True, fresh=True)
    if roles.reward is not None and roles.reward.local is not None:
        try:
            roles.reward.local.wait_ready(timeout_s=120, proc=roles.reward_proc)
        except RuntimeError as e:
            log = (run_dir / "reward_service.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(
                f"{e}; its log ({run_dir / 'reward_service.log'}) ends:\n{log}"
            ) from None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    roles.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def start_rollout(spec: RolloutSpec, placement: Placement) -> list[Any]:
    """One rollout worker per engine placement (not waited for; each joins the push
    group while it is constructed)."""
    return [start_rollout_worker(spec, i, opts) for i, opts in enumerate(placement.rollout)]


def allocator_options(device: str) -> dict[str, Any]:
    """Ray actor options that start a role's process on jemalloc on CPU
    (`cpu_allocator_env`); none where nothing is preloaded."""
    env = cpu_allocator_env(device)
    return {"runtime_env": {"env_vars": env}} if env else {}


def start_rollout_worker(spec: RolloutSpec, index: int, options: dict[str, Any]) -> Any:
    """Rollout worker `index` on its placement bundle `options` (not waited for). With
    partial rollouts it is a threaded actor, so a push reaches it while it generates and
    it holds its share of the producer's one-group requests at once (up to 256, vLLM's
    default batch limit; more wait in Ray's queue). On CPU it runs on jemalloc
    (`cpu_allocator_env`), as the learner ranks do."""
    worker = ray.remote(num_cpus=0)(RolloutWorker)
    if spec.partial:
        options = {**options, "max_concurrency": rollout_concurrency(spec)}
    return worker.options(**options, **allocator_options(spec.engine.device)).remote(
        index,
        spec.engine,
        spec.transport,
        spec.threads,
        partial=spec.partial,
        debug=spec.debug,
    )


def reform_push_group(roles: Roles, recipe: Recipe) -> None:
    """Form a new weight broadcast group (`weight_sync.type: collective`) of learner rank
    0 and every engine, on a new rendezvous store, after a member was replaced (a gloo or
    NCCL group cannot take a new process). Every member must be idle; the new members
    were started without a `group_address`. The caller pushes the policy again.

    Raises:
        WeightSyncError: the group did not form within `weight_sync.timeout_s`.
    """
    old = roles.group
    roles.group = GroupStore(len(roles.rollout) + 1, recipe.weight_sync.timeout_s)
    address, world = roles.group.address, roles.group.world_size
    ray.get(
        [roles.learners[0].join_push_group.remote(address, world)]
        + [w.join_push_group.remote(address, world) for w in roles.rollout]
    )
    if old is not None:
        old.close()


def _launch_learners(
    recipe: Recipe,
    algo: Algorithm,
    model_path: str,
    placement: Placement,
    threads: int,
    transport: TransportSettings,
    resume_from: str | None,
    run_dir: Path | None = None,
    watch: list[Any] | None = None,
) -> list[Any]:
    # The recovery path (recipes/recovery.py) relaunches with (transport, resume_from).
    return start_learners(
        recipe, algo, model_path, placement, threads, transport, resume_from, run_dir, watch
    )


def start_learners(
    recipe: Recipe,
    algo: Algorithm,
    model_path: str,
    placement: Placement,
    threads: int,
    transport: TransportSettings,
    resume_from: str | None = None,
    run_dir: Path | None = None,
    watch: list[Any] | None = None,
) -> list[Any]:
    """Start the FSDP2 learner ranks on their placement with the algorithm's loss,
    reference and critic, and wait until they are set up. The group meets at rank 0's
    node address (recipes/cluster.py records where each rank landed in `run_dir`).
    `watch`: rollout workers being constructed meanwhile (rank 0's set-up joins the
    push group with them); one that dies fails the wait at once (`get_watching`).

    Raises:
        RecipeError: an adapter target names no linear layer (checked before loading),
            or a learner node cannot see `run_dir`.
        RuntimeError: a watched rollout worker died while starting (named).
    """
    from ...learner.adapters import check_targets, format_memory_report
    from ...learner.distributed import format_cuda_memory
    from ...learner.worker import LearnerWorker
    from ..cluster import check_shared_run_dir, learner_places, record_places

    adapter = recipe.model.adapter
    if adapter.type != "none":  # a meta-device model: no weights read
        try:
            check_targets(model_path, tuple(adapter.target_modules))
        except ValueError as e:
            raise RecipeError(str(e)) from None
    settings = learner_settings(recipe, algo, model_path, transport)
    worker = ray.remote(num_cpus=0)(LearnerWorker)
    extra = allocator_options(recipe.resources.device)
    learners = [
        worker.options(**opts, **extra).remote(r, len(placement.learner), settings, threads)
        for r, opts in enumerate(placement.learner)
    ]
    places = learner_places(learners)
    master = places[0]["address"]
    if run_dir is not None:
        record_places(run_dir, places, master)
        check_shared_run_dir(run_dir, places)
    reports = get_watching([lw.setup.remote(master, resume_from) for lw in learners], watch or [])
    print(format_memory_report(reports[0]), flush=True)
    if cuda_line := format_cuda_memory(reports[0]):
        print(cuda_line, flush=True)
    return learners


def get_watching(refs: list[Any], workers: list[Any], poll_s: float = 0.5) -> list[Any]:
    """`ray.get(refs)`, failing as soon as one of the rollout `workers` (actors still
    being constructed) has died: members of the push group wait for each other, so a
    worker that dies in `__init__` would otherwise keep everyone waiting until
    `weight_sync.timeout_s`.

    Raises:
        RuntimeError: rollout worker i died while starting (its error, shortened); the
            caller stops the other roles.
    """
    ready = {w.__ray_ready__.remote(): i for i, w in enumerate(workers)}
    pending = list(refs)
    while True:
        if ready:
            up, _ = ray.wait(list(ready), num_returns=len(ready), timeout=0)
            for ref in up:
                i = ready.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    cause = str(e).strip().splitlines()
                    raise RuntimeError(
                        f"rollout worker {i} died while starting, so the push group cannot "
                        f"form (the others would wait weight_sync.timeout_s): "
                        f"{' '.join(cause[-3:])[-600:]}"
                    ) from e
        if not pending:
            return ray.get(list(refs))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)


def start_rewards(recipe: Recipe, run_dir: Path) -> tuple[RewardSet, LocalServiceLaunch | None]:
    """Clients for the recipe's rewards, and how to start the local reward service for
    the built-in components (with a per-run bearer token; the caller starts it)."""
    cfg, local, launch = recipe.reward_service, None, None
    builtin = [c.model_dump() for c in recipe.rewards if c.type in LOCAL_TYPES]
    if builtin:
        token, port = secrets.token_urlsafe(16), free_port()
        launch = LocalServiceLaunch(
            json.dumps(builtin), port, token, run_dir / "reward_service.log", cfg.workers
        )
        local = RewardClient(
            f"http://127.0.0.1:{port}/score",
            token=token,
            timeout_s=cfg.timeout_s,
            retries=cfg.retries,
            batch_size=cfg.batch_size,
        )
    endpoints = [
        (
            c.name,
            c.weight,
            RewardClient(
                c.url,
                token=os.environ.get(c.token_env) if c.token_env else None,
                timeout_s=c.timeout_s,
                retries=c.retries,
                batch_size=c.batch_size,
                protocol=c.protocol,
                max_concurrency=c.max_concurrency,
            ),
        )
        for c in recipe.rewards
        if c.type == "http"
    ]
    local_sources = [c.sources for c in recipe.rewards if c.type in LOCAL_TYPES]
    endpoint_sources = {c.name: c.sources for c in recipe.rewards if c.type == "http"}
    return RewardSet(local, endpoints, local_sources, endpoint_sources), launch


def stop_roles(roles: Roles | None) -> None:
    """Stop the verifiers v1 drivers, the environment server, the reward service and
    the Ray actors; safe to call twice."""
    if roles is None:
        return
    roles.vf1_drivers.stop()  # first: their episodes call the rollout workers
    if roles.env_server is not None:
        roles.env_server.stop()
    if roles.reward is not None:
        roles.reward.close()
    if roles.reward_proc is not None and roles.reward_proc.poll() is None:
        roles.reward_proc.terminate()
        try:
            roles.reward_proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            roles.reward_proc.kill()
    # Let transports release what outlives a process (filesystem: files in /dev/shm).
    closing = [a.close.remote() for a in roles.rollout + roles.learners]
    try:
        if closing:  # (ray.wait of nothing would start a local cluster to return)
            ray.wait(closing, num_returns=len(closing), timeout=30)
    except ray.exceptions.RayError:  # an actor already dead: nothing of it to close
        pass
    for a in roles.rollout + roles.learners:
        ray.kill(a)
    if roles.group is not None:
        roles.group.close()
    release(roles.placement)


def init_ray(recipe: Recipe, address: str | None, rollout: bool = True) -> None:
    """Join `address` (or RAY_ADDRESS), else start an embedded cluster; on device cpu
    declare as many GPUs as the recipe asks for (`rollout`: engines too) so the same
    placement code runs; on device cuda Ray counts the real GPUs, after
    `check_local_cuda`.

    Raises:
        RecipeError: device cuda on a machine without (enough) CUDA GPUs.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    quiet = "posttrain.common.process.quiet_logs"  # in every worker, before its imports
    if address:
        ray.init(address=address, runtime_env={"worker_process_setup_hook": quiet})
        return
    cuda = recipe.resources.device == "cuda"
    if cuda:
        from ..cluster import check_local_cuda

        check_local_cuda(recipe.resources, rollout)
    ray.init(
        num_cpus=os.cpu_count(),
        num_gpus=None if cuda else gpus_needed(recipe.resources, rollout=rollout),
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={
            "env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"},
            "worker_process_setup_hook": quiet,
        },
    )


def write_manifest(run_dir: Path, recipe: Recipe, model_path: str) -> None:
    """The validated recipe (as `load_recipe` reads it back) and the resolved model
    folder."""
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    (run_dir / "run.json").write_text(
        json.dumps({"model_path": model_path, "torch": torch.__version__, "started": time.time()})
    )
