"""The roles' settings, built from a recipe as plain values (no process started): the
rollout engine, a rollout worker's whole spec, the weight transport and the learner
ranks' settings. `posttrain plan` and `posttrain assess` build the same ones."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ...actors.debug import DebugSettings
from ...actors.engine import EngineSettings
from ...config import Recipe, producer_window
from ...weightsync import TransportSettings

if TYPE_CHECKING:
    from ...learner.settings import LearnerSettings
    from ..algo.base import Algorithm


@dataclass
class RolloutSpec:
    """What starting one rollout worker takes, kept to replace a dead one."""

    engine: EngineSettings
    transport: TransportSettings
    threads: int
    debug: DebugSettings = field(default_factory=DebugSettings)
    partial: bool = False
    window: int = 0  # partial rollouts: the producer's most groups in flight at once
    engines: int = 1  # rollout engines sharing the window


def engine_settings(recipe: Recipe, model_path: str) -> EngineSettings:
    """The recipe's inference engine (`rollout.engine`, `rollout.vllm`, the model's dtype)
    as the rollout workers build it; `plan --gpu cpu` times the same engine."""
    v = recipe.rollout.vllm
    kind = recipe.rollout.engine
    return EngineSettings(
        kind="vllm_async" if kind == "vllm" and v.async_engine else kind,
        model_path=model_path,
        dtype=recipe.model.dtype,
        seed=recipe.train.seed,
        kv_cache_gb=v.kv_cache_gb,
        max_model_len=v.max_model_len,
        enforce_eager=v.enforce_eager,
        device=recipe.resources.device,
        lora_rank=recipe.model.adapter.r if adapter_sync(recipe) else None,
        gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=recipe.resources.rollout.gpus_per_engine,
        sleep_between_steps=(
            recipe.resources.colocate
            and recipe.resources.device == "cuda"
            and recipe.rollout.engine == "vllm"
        ),
        direct_load=v.direct_load,
    )


def rollout_spec(
    recipe: Recipe, model_path: str, threads: int, transport: TransportSettings
) -> RolloutSpec:
    """The recipe's engine, transport and debug settings for a rollout worker."""
    engine = engine_settings(recipe, model_path)
    return RolloutSpec(
        engine,
        transport,
        threads,
        DebugSettings(
            delay_s=recipe.debug.rollout_delay_s,
            fail_push=recipe.debug.fail_weight_push,
            push_delay_s=recipe.debug.push_delay_s,
            tail=(recipe.debug.rollout_tail_every, recipe.debug.rollout_tail_factor),
        ),
        partial=recipe.rollout.partial and recipe.train.max_staleness >= 1,
        window=producer_window(recipe),
        engines=recipe.resources.rollout.engines,
    )


def rollout_concurrency(spec: RolloutSpec) -> int:
    """A partial-rollout worker's Ray `max_concurrency`: its share of the producer's
    window, ceil(window / engines), capped at 256 (vLLM's default batch limit; calls
    beyond wait in Ray's queue, no thread each), plus 4 for pushes and health calls."""
    share = -(-spec.window // max(spec.engines, 1))
    return 4 + min(share, 256)


def adapter_sync(recipe: Recipe) -> bool:
    """Whether engines receive only the adapter each step (`weight_sync.adapter_mode`)."""
    return recipe.model.adapter.type != "none" and recipe.weight_sync.adapter_mode == "adapter"


def transport_settings(recipe: Recipe, run_dir: Path) -> TransportSettings:
    """The recipe's `weight_sync` as plain values; a filesystem transport gets a folder
    of its own under `weight_sync.directory`."""
    ws = recipe.weight_sync
    return TransportSettings(
        type=ws.type,
        bucket_mb=ws.bucket_mb,
        timeout_s=ws.timeout_s,
        backend="nccl" if recipe.resources.device == "cuda" else "gloo",
        directory=str(Path(ws.directory) / f"{run_dir.name}-{os.getpid()}"),
        checksum=ws.verify_checksum,
        delta=ws.delta,
        adapter_only=adapter_sync(recipe),
        shm_gather=ws.shm_gather,
        shm_broadcast=ws.shm_broadcast,
    )


def learner_settings(
    recipe: Recipe, algo: Algorithm, model_path: str, transport: TransportSettings
) -> LearnerSettings:
    """The learner ranks' settings: the recipe's `train` and `model` blocks with the
    algorithm object's loss, head, reference and critic, and the weight transport."""
    from ...learner.adapters import AdapterSettings
    from ...learner.settings import LearnerSettings

    adapter = recipe.model.adapter
    t = recipe.train
    return LearnerSettings(
        model_path=model_path,
        compute_dtype=recipe.model.dtype,
        lr=t.lr,
        betas=t.betas,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        max_grad_norm=t.max_grad_norm,
        micro_batch_size=t.micro_batch_size,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        temperature=algo.temperature,
        seed=t.seed,
        algorithm=algo.name,
        loss=algo.loss,
        head=algo.head,
        load_reference=algo.load_reference,
        reference_path=algo.reference_path,
        critic=algo.critic,
        transport=transport,
        adapter=AdapterSettings(
            **{**adapter.model_dump(), "target_modules": tuple(adapter.target_modules)}
        ),
        delay_s=recipe.debug.learner_delay_s,
        device=recipe.resources.device,
        gradient_checkpointing=t.gradient_checkpointing,
        compile=t.compile,
        sessions=getattr(algo, "sessions", None),  # posttrain serve: LoRA sessions
    )
