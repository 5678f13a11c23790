"""posttrain's configuration: the recipe schema as pydantic models (no torch, no ML
stack), importable by every role, the CLI and a reward host alike.

Each block lives in its own module: `recipe` (the whole `Recipe` and the rules that
span blocks), `model`, `rollout` (with `rollout.vllm`), `train` (with `reward_service`),
`weight_sync`, `data`, `rewards`, `algorithms`, `adapter`, `resources`, `monitor` (monitor and
debug), `evaluation`, `facts` (what each algorithm asks of a run), `episodes`
(multi-turn keys) and `asynchrony` (rules of `train.max_staleness` / `train.correction`,
and the producer's window);
`base` holds `Strict` and `RecipeError`.
"""

from .adapter import AdapterConfig
from .algorithms import DPOConfig, GRPOConfig, PPOConfig
from .asynchrony import continues_prefixes, continuous_producer, producer_window
from .base import RecipeError, Strict
from .data import (
    DataConfig,
    FileData,
    GeneratorData,
    JsonlData,
    MixtureData,
    PreferenceData,
    ReasoningGymData,
)
from .facts import AlgorithmFacts, Passes
from .monitor import AdvisoriesConfig, HackingConfig
from .recipe import Recipe, default_facts
from .resources import ResourcesConfig
from .rewards import LOCAL_TYPES, RewardServerConfig, RewardSpec
from .rollout import RolloutConfig, vllm_installed
from .weight_sync import WeightSyncConfig

__all__ = [
    "LOCAL_TYPES",
    "AdapterConfig",
    "AlgorithmFacts",
    "AdvisoriesConfig",
    "DPOConfig",
    "DataConfig",
    "FileData",
    "GRPOConfig",
    "HackingConfig",
    "GeneratorData",
    "JsonlData",
    "MixtureData",
    "PPOConfig",
    "Passes",
    "PreferenceData",
    "ReasoningGymData",
    "Recipe",
    "RecipeError",
    "ResourcesConfig",
    "RewardServerConfig",
    "RewardSpec",
    "RolloutConfig",
    "Strict",
    "WeightSyncConfig",
    "default_facts",
    "continues_prefixes",
    "continuous_producer",
    "producer_window",
    "vllm_installed",
]
