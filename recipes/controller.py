"""The controller's role handling: start and stop the roles of one run, and the
named calls a step is made of (`generate`, `score`, `on_learners`, `push_weights`,
telemetry, the rollout files). The loop itself is recipes/loop.py; what an algorithm
does with a step is recipes/algorithm.py.

Each step's rollouts and scores are written to disk before training on them, so a
crash loses no scored sample.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import PromptRequest, Rollout, SamplingSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.algorithms.batch import TrainBatch
from posttrain.common.net import free_port
from posttrain.common.process import default_threads
from posttrain.common.telemetry import Span, busy_seconds, generation_tail, idle_fraction
from posttrain.config import LOCAL_TYPES, Recipe, RecipeError
from posttrain.recipes.data import PromptItem
from posttrain.recipes.loading import dump_recipe
from posttrain.recipes.placement import Placement, gpus_needed, place, release
from posttrain.rewards.client import RewardClient, RewardSet, start_local_service
from posttrain.rewards.protocol import Score, ScoreItem
from posttrain.weightsync import GroupStore, TransportSettings, make_transport, push

if TYPE_CHECKING:
    from posttrain.recipes.algorithm import Algorithm


@dataclass
class Roles:
    """Handles of every running role of one job (no rollout side for DPO)."""

    learners: list[Any]
    placement: Placement
    pad_id: int = 0
    rollout: list[Any] = field(default_factory=list)
    reward: RewardSet | None = None
    reward_proc: subprocess.Popen | None = None
    group: GroupStore | None = None  # the push group's rendezvous (collective transport)
    last_push_bytes: int = 0  # tensor bytes of the newest weight push


def start_roles(recipe: Recipe, algo: Algorithm, model_path: str, run_dir: Path,
                resume_from: str | None = None) -> Roles:
    """Start the learner group and, when the algorithm samples (`algo.uses_rollouts`),
    the reward service, the rollout workers and their push group. `resume_from`: the
    learners' training state to load (a checkpoint's `learner/` folder).

    Raises:
        RecipeError: an adapter target that names no layer of the model.
        RuntimeError: a role failed to start (the message names it).
    """
    res = recipe.resources
    placement = place(res, rollout=algo.uses_rollouts)
    n_rollout, n_learn = len(placement.rollout), len(placement.learner)
    # Synchronous mode: the rollout side and the learner side never compute at once,
    # so each side gets all cores, split among its own workers.
    threads_r = res.threads_per_worker or default_threads(max(n_rollout, 1))
    threads_l = res.threads_per_worker or default_threads(n_learn)
    roles = Roles(learners=[], placement=placement)
    transport = transport_settings(recipe, run_dir)
    if algo.uses_rollouts:
        roles.reward, roles.reward_proc = start_rewards(recipe, run_dir)
        if make_transport(transport.type).needs_group:
            roles.group = GroupStore(n_rollout + 1, recipe.weight_sync.timeout_s)
            transport = replace(transport, group_address=roles.group.address,
                                group_world=roles.group.world_size)
        roles.rollout = start_rollout(recipe, model_path, placement, threads_r, transport)
    roles.learners = start_learners(recipe, algo, model_path, placement, threads_l, transport,
                                    resume_from)
    if roles.rollout:
        ray.get([w.health.remote() for w in roles.rollout])
    if adapter_sync(recipe) and recipe.model.adapter.type == "qlora":
        # Engines serve base + adapter; their base must be the learner's NF4 base
        # dequantised, not the checkpoint: send it once, as policy_version 0.
        push(roles.learners, roles.rollout, 0, recipe.weight_sync.timeout_s, full=True)
    if roles.reward is not None and roles.reward.local is not None:
        try:
            roles.reward.local.wait_ready(timeout_s=120, proc=roles.reward_proc)
        except RuntimeError as e:
            log = (run_dir / "reward_service.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(
                f"{e}; its log ({run_dir / 'reward_service.log'}) ends:\n{log}") from None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    roles.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return roles


def start_rollout(recipe: Recipe, model_path: str, placement: Placement, threads: int,
                  transport: TransportSettings) -> list[Any]:
    """One rollout worker per engine placement (not waited for; each joins the push
    group while it is constructed)."""
    v = recipe.rollout.vllm
    engine = EngineSettings(
        kind=recipe.rollout.engine, model_path=model_path, dtype=recipe.model.dtype,
        seed=recipe.train.seed, kv_cache_gb=v.kv_cache_gb, max_model_len=v.max_model_len,
        enforce_eager=v.enforce_eager, device=recipe.resources.device,
        lora_rank=recipe.model.adapter.r if adapter_sync(recipe) else None,
    )
    worker = ray.remote(num_cpus=0)(RolloutWorker)
    return [worker.options(**opts).remote(i, engine, transport, threads,
                                          recipe.debug.rollout_delay_s)
            for i, opts in enumerate(placement.rollout)]


def adapter_sync(recipe: Recipe) -> bool:
    """Whether engines receive only the adapter each step (`weight_sync.adapter_mode`)."""
    return recipe.model.adapter.type != "none" and recipe.weight_sync.adapter_mode == "adapter"


def transport_settings(recipe: Recipe, run_dir: Path) -> TransportSettings:
    """The recipe's `weight_sync` as plain values; a filesystem transport gets a folder
    of its own under `weight_sync.directory`."""
    ws = recipe.weight_sync
    return TransportSettings(
        type=ws.type, bucket_mb=ws.bucket_mb, timeout_s=ws.timeout_s,
        backend="nccl" if recipe.resources.device == "cuda" else "gloo",
        directory=str(Path(ws.directory) / f"{run_dir.name}-{os.getpid()}"),
        checksum=ws.verify_checksum, adapter_only=adapter_sync(recipe),
    )


def start_learners(recipe: Recipe, algo: Algorithm, model_path: str, placement: Placement,
                   threads: int, transport: TransportSettings,
                   resume_from: str | None = None) -> list[Any]:
    """Start the FSDP2 learner ranks on their placement with the algorithm's loss,
    reference and critic, and wait until they are set up.

    Raises:
        RecipeError: an adapter target names no linear layer (checked before loading).
    """
    from posttrain.learner.adapters import AdapterSettings, check_targets, format_memory_report
    from posttrain.learner.settings import LearnerSettings
    from posttrain.learner.worker import LearnerWorker

    adapter = recipe.model.adapter
    if adapter.type != "none":  # a meta-device model: no weights read
        try:
            check_targets(model_path, tuple(adapter.target_modules))
        except ValueError as e:
            raise RecipeError(str(e)) from None
    t = recipe.train
    settings = LearnerSettings(
        model_path=model_path, compute_dtype=recipe.model.dtype, lr=t.lr, betas=t.betas,
        weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
        max_grad_norm=t.max_grad_norm, micro_batch_size=t.micro_batch_size,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        temperature=algo.temperature, seed=t.seed, algorithm=algo.name, loss=algo.loss,
        load_reference=algo.load_reference, critic=algo.critic, transport=transport,
        adapter=AdapterSettings(**{**adapter.model_dump(),
                                   "target_modules": tuple(adapter.target_modules)}),
        delay_s=recipe.debug.learner_delay_s,
    )
    worker = ray.remote(num_cpus=0)(LearnerWorker)
    learners = [worker.options(**opts).remote(r, len(placement.learner), settings, threads)
                for r, opts in enumerate(placement.learner)]
    master = free_port()
    reports = ray.get([lw.setup.remote(master, resume_from) for lw in learners])
    print(format_memory_report(reports[0]), flush=True)
    return learners


def start_rewards(recipe: Recipe, run_dir: Path) -> tuple[RewardSet, subprocess.Popen | None]:
    """Start a local reward service for the built-in components (with a per-run bearer
    token) and clients for the recipe's HTTP endpoints."""
    cfg, local, proc = recipe.reward_service, None, None
    builtin = [c.model_dump() for c in recipe.rewards if c.type in LOCAL_TYPES]
    if builtin:
        token, port = secrets.token_urlsafe(16), free_port()
        proc = start_local_service(json.dumps(builtin), port, token,
                                   run_dir / "reward_service.log", workers=cfg.workers)
        local = RewardClient(f"http://127.0.0.1:{port}/score", token=token,
                             timeout_s=cfg.timeout_s, retries=cfg.retries,
                             batch_size=cfg.batch_size)
    endpoints = [
        (c.name, c.weight, RewardClient(
            c.url, token=os.environ.get(c.token_env) if c.token_env else None,
            timeout_s=c.timeout_s, retries=c.retries, batch_size=c.batch_size,
            protocol=c.protocol, max_concurrency=c.max_concurrency))
        for c in recipe.rewards if c.type == "http"
    ]
    return RewardSet(local, endpoints), proc


def stop_roles(roles: Roles | None) -> None:
    """Stop the reward service and the Ray actors; safe to call twice."""
    if roles is None:
        return
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
        ray.wait(closing, num_returns=len(closing), timeout=30)
    except ray.exceptions.RayError:  # an actor already dead: nothing of it to close
        pass
    for a in roles.rollout + roles.learners:
        ray.kill(a)
    if roles.group is not None:
        roles.group.close()
    release(roles.placement)


def generate(
    roles: Roles, prompts: list[PromptItem], recipe: Recipe, step: int, round_: int = 0
) -> list[Rollout]:
    """Sample a group per prompt, spreading prompts over the rollout workers. `round_`
    (dynamic sampling's extra rounds of a step) gives distinct group ids and seeds."""
    messages = []
    for p in prompts:
        m = [{"role": "user", "content": p.question}]
        if recipe.model.system_prompt:
            m.insert(0, {"role": "system", "content": recipe.model.system_prompt})
        messages.append(m)
    requests = [
        PromptRequest(f"s{step}{f'r{round_}' if round_ else ''}-p{p.prompt_id}-{i}", m,
                      p.ground_truth, p.metadata)
        for i, (p, m) in enumerate(zip(prompts, messages, strict=True))
    ]
    sampling = SamplingSettings(
        n=recipe.rollout.samples_per_prompt,
        max_new_tokens=recipe.rollout.max_new_tokens,
        temperature=recipe.rollout.temperature,
        top_p=recipe.rollout.top_p,
        seed=recipe.train.seed * 100_003 + step + 1_000_003 * round_,
        stop=tuple(recipe.rollout.stop),
    )
    n = len(roles.rollout)
    chunks = [requests[i::n] for i in range(n)]
    futures = [w.generate.remote(c, sampling, step)
               for w, c in zip(roles.rollout, chunks, strict=True) if c]
    return [r for part in ray.get(futures) for r in part]


def score(roles: Roles, rollouts: list[Rollout]) -> list[Score]:
    """One `Score` per rollout, in order (`reward` None when scoring failed)."""
    items = [
        ScoreItem(uid=r.uid, prompt=r.prompt_text, response=r.response_text,
                  ground_truth=r.ground_truth, metadata=r.metadata)
        for r in rollouts
    ]
    return roles.reward.score(items)


def on_learners(learners: list[Any], method: str, batch: TrainBatch, *args: Any) -> list[Any]:
    """Call `method(shard_r, *args)` on every learner rank at once (a collective) and
    return each rank's result; `len(batch)` must split evenly over the ranks."""
    world = len(learners)
    return ray.get([getattr(lw, method).remote(batch.shard(r, world), *args)
                    for r, lw in enumerate(learners)])


def push_weights(roles: Roles, recipe: Recipe, version: int) -> float:
    """Publish the new policy and wait for every engine to hold `version`; seconds.

    Raises:
        WeightSyncError: an engine failed to load, did not answer within
            `weight_sync.timeout_s`, or reports another version; names engine and version.
    """
    t0 = time.time()
    handle = push(roles.learners, roles.rollout, version, recipe.weight_sync.timeout_s)
    roles.last_push_bytes = handle.num_bytes
    return time.time() - t0


def step_telemetry(
    roles: Roles, start: float, end: float, extra: list[Span]
) -> tuple[dict[str, float], list[Span]]:
    """Idle fractions, busy seconds and generation tail of one step from every worker's
    spans (plus the controller's own `extra` spans); returns metrics and all spans."""
    spans: list[Span] = [s for part in ray.get(
        [a.drain_spans.remote() for a in roles.rollout + roles.learners]) for s in part]
    n_r, n_l = len(roles.rollout), len(roles.learners)
    return {
        "rollout_idle_fraction": idle_fraction(spans, "rollout", n_r, start, end),
        "learner_idle_fraction": idle_fraction(spans, "learner", n_l, start, end),
        "rollout_busy_s": busy_seconds(spans, "rollout", n_r, start, end),
        "learner_busy_s": busy_seconds(spans, "learner", n_l, start, end),
        "time/generation_tail": generation_tail(spans),
    }, spans + extra


def save_rollouts(run_dir: Path, step: int, rollouts: list[Rollout], scores: list[Score]) -> None:
    """One jsonl per step: every rollout with its reward (and the scoring error in
    `reward_details.error`), written before training on it."""
    folder = run_dir / "rollouts"
    folder.mkdir(exist_ok=True)
    with open(folder / f"step_{step:05d}.jsonl", "w") as f:
        for r, s in zip(rollouts, scores, strict=True):
            details = s.details | ({"error": s.error} if s.error else {})
            f.write(json.dumps(r.to_dict() | {"reward": s.reward, "reward_details": details})
                    + "\n")


def init_ray(recipe: Recipe, address: str | None, rollout: bool = True) -> None:
    """Join `address` (or RAY_ADDRESS), else start an embedded cluster; on device cpu
    declare as many GPUs as the recipe asks for (`rollout`: engines too) so the same
    placement code runs."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(num_cpus=os.cpu_count(), num_gpus=gpus_needed(recipe.resources, rollout=rollout),
             include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "HF_HUB_OFFLINE": "1"}})


def write_manifest(run_dir: Path, recipe: Recipe, model_path: str) -> None:
    """The validated recipe (as `load_recipe` reads it back) and the resolved model
    folder."""
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    (run_dir / "run.json").write_text(json.dumps({
        "model_path": model_path, "torch": torch.__version__, "started": time.time()}))
