"""The `posttrain serve` configuration (pydantic only, no torch): which base model the
service trains, on which roles (`resources`, the same block a recipe has), how sampler
weights reach the engines (`weight_sync`) and how many LoRA sessions share the base.

Which way it travels: a YAML file given to `posttrain serve --config` (or the defaults
plus flags) → `service.stack.Stack`, which starts the learner group and the rollout
engines through the recipes' start-up path (`recipes.roles.start_roles`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from .adapter import DEFAULT_LORA_TARGETS
from .base import RecipeError, Strict
from .recipe import ResourcesConfig, VLLMConfig, WeightSyncConfig, vllm_installed
from .yamlfile import read_yaml


class SessionsConfig(Strict):
    """How LoRA sessions share the one base model on every learner rank and engine."""

    max_rank: int = Field(
        32,
        gt=0,
        le=512,
        description="Largest LoRA rank a session may ask for. The learner keeps one adapter "
        "slot of this rank; a session of rank r uses its first r rows (exact: the rest stay "
        "zero) and engines size their LoRA slots by it.",
    )
    max_sessions: int = Field(
        16, gt=0, description="Training models (LoRA sessions) alive at once; more is a 409."
    )
    adapter_slots: int = Field(
        4,
        gt=0,
        description="Named LoRA adapters an engine batches at once (vLLM's max_loras); "
        "others wait in its CPU cache and are reloaded from their folder when asked for.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="Linear layers that carry a session's adapter (train_attn / train_mlp "
        "choose among them per session).",
    )
    batch: int = Field(
        1,
        ge=1,
        le=8,
        description="forward / forward_backward requests of up to this many sessions that "
        "wait together run as one learner pass, each session's rows with its own adapter "
        "and gradients (each row computes only its session's rank). The learner's adapter "
        "slot then holds batch x max_rank ranks; 1: one session per pass.",
    )
    batch_wait_s: float = Field(
        0.05,
        ge=0,
        le=10,
        description="With batch > 1: how long a forward / forward_backward request waits "
        "for other sessions' requests to join its learner pass (requests sent at once "
        "arrive milliseconds apart; without a wait the first runs alone).",
    )
    micro_batch_size: int = Field(
        8, gt=0, description="Rows per forward/backward on each learner rank."
    )
    idle_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A session not heard from (requests or the SDK's heartbeats) for this "
        "long has its waiting requests cancelled, so a dead client does not keep the "
        "roles busy; its models and saved states stay.",
    )
    save_every_s: float = Field(
        0.0,
        ge=0,
        description="Also persist every live session (adapter, AdamW state, step) under "
        "--root this often, in seconds, between its requests; 0: only on save_state. A "
        "restart continues each session from its newest saved state.",
    )


class ServiceModel(Strict):
    path: str = Field(
        "smollm2-135m-instruct",
        description="The base model every session trains: built-in alias or local folder.",
    )
    name: str | None = Field(
        None, description="The name clients ask for (`base_model`); default: `path`."
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="Compute dtype of the learner's forward/backward and of the engines; "
        "master weights and AdamW state stay float32.",
    )


class ServiceRollout(Strict):
    engine: Literal["vllm", "hf"] = Field(
        default_factory=lambda: "vllm" if vllm_installed() else "hf",
        description="Inference engine of each rollout worker: 'vllm' (default where "
        "installed) or 'hf'.",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


class ServiceConfig(Strict):
    """A whole `posttrain serve` configuration; see recipes/serve.yaml."""

    model: ServiceModel = Field(default_factory=ServiceModel)
    rollout: ServiceRollout = Field(default_factory=ServiceRollout)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    seed: int = Field(0, description="Seed of the roles' start-up (engines, learner).")

    @model_validator(mode="after")
    def _fits(self) -> ServiceConfig:
        if self.resources.colocate:
            raise ValueError(
                "resources.colocate: the service keeps its engines serving while the "
                "learner trains; give each side its own devices (colocate: false)"
            )
        if self.rollout.vllm.async_engine:
            raise ValueError(
                "rollout.vllm.async_engine: sessions' adapters are served by vLLM's "
                "synchronous engine; set it false"
            )
        if self.weight_sync.delta:
            raise ValueError("weight_sync.delta: sampler weights are adapters; set it false")
        return self

    @property
    def base_name(self) -> str:
        return self.model.name or self.model.path


def load_service_config(path: Path | None, overrides: dict | None = None) -> ServiceConfig:
    """The service configuration of YAML file `path` (None: the defaults) with
    `overrides` (top-level blocks, e.g. from flags) merged over it.

    Raises:
        RecipeError: the file is missing or not YAML, or a key is wrong (named).
    """
    data: dict = {}
    if path is not None:
        loaded = read_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"{path}: the top level must be a mapping of blocks")
        data = loaded or {}
    for block, values in (overrides or {}).items():
        if isinstance(values, dict):
            data[block] = {**(data.get(block) or {}), **values}
        else:
            data[block] = values
    try:
        return ServiceConfig.model_validate(data)
    except ValidationError as e:
        where = f"{path}: " if path else ""
        first = e.errors()[0]
        key = ".".join(str(x) for x in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = "unknown key; remove it or fix its spelling (every key: config/service.py)"
        raise RecipeError(f"{where}{key}: {msg}") from None
