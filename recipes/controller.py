"""The controller: one process that starts the roles and owns the GRPO step loop.

One step (synchronous, on-policy):
  generate → score → old/ref logprobs → advantages → train_step → push_weights,
and every rollout engine acknowledges `policy_version = step + 1` before the next
generate. Each step's rollouts and rewards are written to disk before training on
them, so a crash loses no scored sample.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
import yaml

from posttrain.actors.engine import EngineSettings
from posttrain.actors.rollout import PromptRequest, Rollout, SamplingSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.common.process import default_threads
from posttrain.common.telemetry import Span, busy_seconds, generation_tail, idle_fraction
from posttrain.learner.batch import TrainBatch, concat, pad_rows_to_multiple
from posttrain.algorithms.common import loss_denominator
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from posttrain.common.net import free_port
from posttrain.recipes.data import PromptItem
from posttrain.recipes.grpo import logprob_mismatch
from posttrain.recipes.placement import Placement, gpus_needed, place, release
from posttrain.config.rewards import LOCAL_TYPES
from posttrain.config import Recipe
from posttrain.rewards.client import RewardClient, RewardSet, start_local_service
from posttrain.rewards.protocol import ScoreItem
from posttrain.weightsync import TransportSettings, WeightSyncError, make_transport


@dataclass
class Roles:
    """Handles of every running role of one job."""

    rollout: list[Any]
    learners: list[Any]
    reward: RewardSet
    reward_proc: subprocess.Popen | None
    pad_id: int
    placement: Placement
    last_push_bytes: int = 0  # tensor bytes of the newest weight push
    stream: Any = None  # collective: a transport (no group) that makes streamed handles
    stream_meta: list | None = None  # the learner's `weight_layout`, asked once


def start_roles(recipe: Recipe, model_path: str, run_dir: Path) -> Roles:
    """Start the reward service, the rollout workers and the learner group.

    Raises:
        RuntimeError: a role failed to start (the message names it).
    """
    res = recipe.resources
    n_rollout = res.rollout.gpus // res.rollout.gpus_per_engine
    n_learn = res.learner.gpus
    reward, proc = start_rewards(recipe, run_dir)
    # Synchronous mode: the rollout side and the learner side never compute at once,
    # so each side gets all cores, split among its own workers.
    threads_r = res.threads_per_worker or default_threads(n_rollout)
    threads_l = res.threads_per_worker or default_threads(n_learn)
    placement = place(res)
    transport = transport_settings(recipe, run_dir)
    v = recipe.rollout.vllm
    engine = EngineSettings(
        kind=recipe.rollout.engine, model_path=model_path, dtype=recipe.model.dtype,
        seed=recipe.train.seed, kv_cache_gb=v.kv_cache_gb, max_model_len=v.max_model_len,
        enforce_eager=v.enforce_eager, device=res.device,
        lora_rank=recipe.model.adapter.r if adapter_sync(recipe) else None,
    )
    Rollout_ = ray.remote(num_cpus=0)(RolloutWorker)
    rollout = [
        Rollout_.options(**opts).remote(i, engine, transport, threads_r,
                                        recipe.debug.rollout_delay_s)
        for i, opts in enumerate(placement.rollout)
    ]
    learners = start_learners(recipe, model_path, placement, threads_l, transport)
    ray.get([w.health.remote() for w in rollout])
    roles = Roles(rollout, learners, reward, proc, 0, placement)
    sender = make_transport(transport)  # never joins: it only lays out streamed handles
    if sender.needs_group:
        join_weight_group(learners[0], rollout)
        roles.stream = sender
    if adapter_sync(recipe) and recipe.model.adapter.type == "qlora":
        # Engines serve base + adapter; their base must be the learner's NF4 base
        # dequantised, not the checkpoint: send it once, as policy_version 0.
        push_weights(roles, recipe, version=0, adapter_only=False)
    if reward.local is not None:
        try:
            reward.local.wait_ready(timeout_s=120, proc=proc)
        except RuntimeError as e:
            log = (run_dir / "reward_service.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(
                f"{e}; its log ({run_dir / 'reward_service.log'}) ends:\n{log}") from None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    roles.pad_id = pad
    return roles


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
    )


def join_weight_group(learner0: Any, rollout: list[Any]) -> None:
    """Form the broadcast group: learner rank 0 is rank 0, engine i is rank i + 1.

    Raises:
        WeightSyncError: a member could not join (the message names it).
    """
    address = ray.get(learner0.weight_group_address.remote())
    world = len(rollout) + 1
    ray.get([learner0.join_weight_group.remote(address, world)]
            + [w.join_weight_group.remote(address, world) for w in rollout])


def start_learners(recipe: Recipe, model_path: str, placement: Placement,
                   threads: int, transport: TransportSettings | None = None) -> list[Any]:
    """Start the FSDP2 learner ranks on their placement and wait until they are set up."""
    from posttrain.learner.adapters import AdapterSettings, check_targets, format_memory_report
    from posttrain.config import RecipeError

    if recipe.model.adapter.type != "none":  # a meta-device model: no weights read
        try:
            check_targets(model_path, tuple(recipe.model.adapter.target_modules))
        except ValueError as e:
            raise RecipeError(str(e)) from None
    dpo, ppo = recipe.algorithm == "dpo", recipe.algorithm == "ppo"
    clip = recipe.ppo.clip_eps if ppo else recipe.grpo.clip_eps
    settings = LearnerSettings(
        model_path=model_path,
        compute_dtype=recipe.model.dtype,
        lr=recipe.train.lr,
        betas=recipe.train.betas,
        weight_decay=recipe.train.weight_decay,
        warmup_steps=recipe.train.warmup_steps,
        max_grad_norm=recipe.train.max_grad_norm,
        micro_batch_size=recipe.train.micro_batch_size,
        clip_low=clip,
        clip_high=clip if ppo else recipe.grpo.clip_eps_high or clip,
        # PPO's k1 penalty lives in the reward; only kl_mode 'loss' puts KL in the loss.
        kl_coef=(recipe.ppo.kl_coef if recipe.ppo.kl_mode == "loss" else 0.0) if ppo
        else recipe.grpo.kl_coef,
        temperature=1.0 if dpo else recipe.rollout.temperature,
        seed=recipe.train.seed,
        transport=transport or TransportSettings(),
        delay_s=recipe.debug.learner_delay_s,
        load_reference=dpo or (recipe.ppo.kl_coef if ppo else recipe.grpo.kl_coef) > 0,
        critic=ppo,
        critic_path=recipe.ppo.critic_path,
        critic_lr=recipe.ppo.critic_lr,
        cliprange_value=recipe.ppo.cliprange_value,
        dpo_beta=recipe.dpo.beta,
        dpo_label_smoothing=recipe.dpo.label_smoothing,
        dpo_loss_type=recipe.dpo.loss_type,
        adapter=AdapterSettings(**{**recipe.model.adapter.model_dump(), "target_modules": tuple(
            recipe.model.adapter.target_modules)}),
    )
    Learner_ = ray.remote(num_cpus=0)(LearnerWorker)
    learners = [Learner_.options(**opts).remote(r, len(placement.learner), settings, threads)
                for r, opts in enumerate(placement.learner)]
    master = free_port()
    reports = ray.get([lw.setup.remote(master) for lw in learners])
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
    roles.reward.close()
    if roles.reward_proc is not None and roles.reward_proc.poll() is None:
        roles.reward_proc.terminate()
        try:
            roles.reward_proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            roles.reward_proc.kill()
    # Let transports release what outlives a process (filesystem: files in /dev/shm).
    closing = [a.close_transport.remote() for a in roles.rollout + roles.learners]
    try:
        ray.wait(closing, num_returns=len(closing), timeout=30)
    except ray.exceptions.RayError:  # an actor already dead: nothing of it to close
        pass
    for a in roles.rollout + roles.learners:
        ray.kill(a)
    release(roles.placement)


def generate(
    roles: Roles, prompts: list[PromptItem], recipe: Recipe, step: int
) -> list[Rollout]:
    """Sample a group per prompt, spreading prompts over the rollout workers."""
    messages = []
    for p in prompts:
        m = [{"role": "user", "content": p.question}]
        if recipe.model.system_prompt:
            m.insert(0, {"role": "system", "content": recipe.model.system_prompt})
        messages.append(m)
    requests = [
        PromptRequest(f"s{step}-p{p.prompt_id}-{i}", m, p.ground_truth, p.metadata)
        for i, (p, m) in enumerate(zip(prompts, messages, strict=True))
    ]
    sampling = SamplingSettings(
        n=recipe.rollout.samples_per_prompt,
        max_new_tokens=recipe.rollout.max_new_tokens,
        temperature=recipe.rollout.temperature,
        top_p=recipe.rollout.top_p,
        seed=recipe.train.seed * 100_003 + step,
        stop=tuple(recipe.rollout.stop),
    )
    n = len(roles.rollout)
    chunks = [requests[i::n] for i in range(n)]
    futures = [w.generate.remote(c, sampling, step)
               for w, c in zip(roles.rollout, chunks, strict=True) if c]
    return [r for part in ray.get(futures) for r in part]


def score(roles: Roles, rollouts: list[Rollout]) -> tuple[list[float | None], list[dict]]:
    """Rewards (None when scoring failed) and details, aligned with `rollouts`."""
    items = [
        ScoreItem(uid=r.uid, prompt=r.prompt_text, response=r.response_text,
                  ground_truth=r.ground_truth, metadata=r.metadata)
        for r in rollouts
    ]
    scores = roles.reward.score(items)
    return [s.reward for s in scores], [s.details | ({"error": s.error} if s.error else {})
                                        for s in scores]


def on_learners(learners: list[Any], method: str, batch: TrainBatch, *args: Any) -> list[Any]:
    """Call `method(shard_r, *args)` on every learner rank at once (a collective) and
    return each rank's result; `len(batch)` must split evenly over the ranks."""
    world = len(learners)
    return ray.get([getattr(lw, method).remote(batch.shard(r, world), *args)
                    for r, lw in enumerate(learners)])


def train_on(roles: Roles, batch: TrainBatch, recipe: Recipe, step: int) -> dict[str, float]:
    """old (and ref) logprobs, then one optimizer step on every learner rank."""
    b, t0 = len(batch), time.time()
    padded = pad_rows_to_multiple(batch, len(roles.learners))
    learners = roles.learners
    padded.old_logprobs = concat(on_learners(learners, "compute_logprobs", padded, step))
    if recipe.grpo.kl_coef > 0:
        padded.ref_logprobs = concat(on_learners(learners, "compute_logprobs", padded, step, True))
    t_train = time.time()
    denom = loss_denominator(padded.response_mask, recipe.grpo.loss_agg)
    stats = on_learners(roles.learners, "train_step", padded, denom, step)[0]
    stats["time/train"] = time.time() - t_train
    stats["time/logprobs"] = t_train - t0
    stats["logprob_mismatch"] = logprob_mismatch(batch, padded.old_logprobs[:b])
    return stats


def push_weights(roles: Roles, recipe: Recipe, version: int,
                 adapter_only: bool | None = None) -> float:
    """Publish the new policy (the adapter alone with `adapter_mode: adapter`) and wait
    for every engine to hold `version`; seconds.

    Raises:
        WeightSyncError: an engine failed to load, did not answer within
            `weight_sync.timeout_s`, or reports another version; names engine and version.
    """
    t0 = time.time()
    check = recipe.weight_sync.verify_checksum
    only = adapter_sync(recipe) if adapter_only is None else adapter_only
    dtype = recipe.model.dtype
    learner_refs = []
    if roles.stream is not None and not check and recipe.model.adapter.type == "none":
        # Streamed: engines receive bucket i while the learner gathers bucket i+1.
        # (With an adapter the learner merges on a copy first: the gather-first path.)
        if roles.stream_meta is None:
            roles.stream_meta = ray.get(roles.learners[0].weight_layout.remote(dtype))
        handle = roles.stream.stream_handle(roles.stream_meta, version)
        learner_refs = [lw.push_weights.remote(version, dtype, False, False, handle)
                        for lw in roles.learners]
    else:
        handle = ray.get([lw.push_weights.remote(version, dtype, check, only)
                          for lw in roles.learners])[0]
    roles.last_push_bytes = handle.num_bytes
    pending = {w.update_weights.remote(handle, version - 1): i
               for i, w in enumerate(roles.rollout)}
    done, late = ray.wait(list(pending), num_returns=len(pending),
                          timeout=recipe.weight_sync.timeout_s)
    if late:
        raise WeightSyncError(
            f"rollout engines {sorted(pending[r] for r in late)} did not acknowledge "
            f"policy_version {version} within {recipe.weight_sync.timeout_s:.0f} s")
    for ref in done:
        if (got := ray.get(ref)) != version:
            raise WeightSyncError(f"rollout engine {pending[ref]} reports policy_version {got} "
                                  f"after a push of {version}")
    # The sender's side (a broadcast thread for 'collective') ends once all engines did.
    ray.get(learner_refs)
    ray.get(roles.learners[0].finish_push.remote(None if learner_refs else handle))
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


def save_rollouts(run_dir: Path, step: int, rollouts: list[Rollout],
                  rewards: list[float | None], details: list[dict]) -> None:
    """One jsonl per step: every rollout with its reward, written before training."""
    folder = run_dir / "rollouts"
    folder.mkdir(exist_ok=True)
    with open(folder / f"step_{step:05d}.jsonl", "w") as f:
        for r, x, d in zip(rollouts, rewards, details, strict=True):
            f.write(json.dumps(r.to_dict() | {"reward": x, "reward_details": d}) + "\n")


def init_ray(recipe: Recipe, address: str | None) -> None:
    """Join `address` (or RAY_ADDRESS), else start an embedded cluster; on device cpu
    declare as many GPUs as the recipe asks for so the same placement code runs."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(num_cpus=os.cpu_count(),
             num_gpus=gpus_needed(recipe.resources, rollout=recipe.algorithm != "dpo"),
             include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                                 "HF_HUB_OFFLINE": "1"}})


def write_manifest(run_dir: Path, recipe: Recipe, model_path: str) -> None:
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"),
                                                        sort_keys=False))
    (run_dir / "run.json").write_text(json.dumps({
        "model_path": model_path, "torch": torch.__version__, "started": time.time()}))
