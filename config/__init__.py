"""posttrain's configuration: the recipe schema as pydantic models (no torch, no ML
stack), importable by every role, the CLI and a reward host alike.

Each block lives in its own module: `recipe` (the whole `Recipe` and its small
blocks), `data`, `rewards`, `algorithms`, `adapter`, `resources`, `monitor` (monitor and
debug), `evaluation`, `episodes` (multi-turn keys) and `asynchrony` (rules of
`train.max_staleness` / `train.correction`); `base` holds `Strict` and `RecipeError`.
"""

from posttrain.config.adapter import AdapterConfig
from posttrain.config.algorithms import DPOConfig, GRPOConfig, PPOConfig
from posttrain.config.base import RecipeError, Strict
from posttrain.config.data import DataConfig, GeneratorData, JsonlData, PreferenceData
from posttrain.config.recipe import (
    AdvisoriesConfig,
    Recipe,
    ResourcesConfig,
    RolloutConfig,
    WeightSyncConfig,
    vllm_installed,
)
from posttrain.config.rewards import LOCAL_TYPES, RewardServerConfig, RewardSpec

__all__ = [
    "LOCAL_TYPES",
    "AdapterConfig",
    "AdvisoriesConfig",
    "DPOConfig",
    "DataConfig",
    "GRPOConfig",
    "GeneratorData",
    "JsonlData",
    "PPOConfig",
    "PreferenceData",
    "Recipe",
    "RecipeError",
    "ResourcesConfig",
    "RewardServerConfig",
    "RewardSpec",
    "RolloutConfig",
    "Strict",
    "WeightSyncConfig",
    "vllm_installed",
]
