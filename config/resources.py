"""The recipe's `resources:` block: how many devices go to rollout and to the learner,
whether they are shared (colocated), and which kind of device (`cpu` with declared GPUs,
or `cuda`). Pydantic only, no torch; whether this machine has the GPUs is checked at run
start (`recipes/cluster.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Strict as _Strict


class RolloutResources(_Strict):
    gpus: int = Field(1, gt=0, description="Devices for rollout (on device: cpu, workers).")
    gpus_per_engine: int = Field(1, gt=0, description="Devices per engine (tensor parallel).")

    @property
    def engines(self) -> int:
        """Rollout engines: `gpus // gpus_per_engine` (the schema refuses a remainder)."""
        return self.gpus // self.gpus_per_engine


class LearnerResources(_Strict):
    gpus: int = Field(
        1, gt=0, description="Learner workers in the FSDP2 group, one device (or CPU process) each."
    )


class ResourcesConfig(_Strict):
    rollout: RolloutResources = Field(default_factory=RolloutResources)
    learner: LearnerResources = Field(default_factory=LearnerResources)
    colocate: bool = Field(
        False,
        description="Rollout engines and learner ranks time-share the same devices "
        "(engine i and rank i on device i) instead of separate ones.",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="'cpu': Ray declares GPU resources so the same placement runs without GPUs; "
        "collectives use gloo. 'cuda': each learner rank and engine runs on the GPU(s) Ray "
        "assigns its actor; the learner group and weight broadcasts use NCCL.",
    )
    rollout_cores: int | None = Field(
        None,
        gt=0,
        description="With train.max_staleness >= 1 both sides compute at once: cores for the "
        "rollout workers (split among them), the rest for the learner ranks; default half "
        "the cores (at least 1 each side). Synchronous runs give each side every core.",
    )
    threads_per_worker: int | None = Field(
        None, gt=0, description="torch threads per worker; default: cores / workers (at least 1)."
    )

    @model_validator(mode="after")
    def _engine_split(self) -> ResourcesConfig:
        if self.rollout.gpus % self.rollout.gpus_per_engine:
            raise ValueError(
                f"rollout.gpus ({self.rollout.gpus}) is not divisible by rollout.gpus_per_engine "
                f"({self.rollout.gpus_per_engine}); set rollout.gpus to a multiple of it"
            )
        if self.rollout.gpus_per_engine != 1 and self.device != "cuda":
            raise ValueError(
                "rollout.gpus_per_engine > 1 runs tensor-parallel vLLM engines, which need "
                "GPUs; set resources.device: cuda, or rollout.gpus_per_engine: 1"
            )
        if self.rollout.gpus_per_engine != 1 and self.colocate:
            raise ValueError(
                "resources.colocate pairs engine i with learner rank i on one GPU, so an "
                "engine cannot span rollout.gpus_per_engine "
                f"({self.rollout.gpus_per_engine}) GPUs; set rollout.gpus_per_engine: 1, or "
                "colocate: false"
            )
        return self
