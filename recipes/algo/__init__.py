"""The algorithm objects on the controller, one module per algorithm, and their registry.

`base.py` knows no subclass; the loop looks an algorithm up once (`algorithm_for`) and
picks its step from the object's kind (`RLAlgorithm`: the rollout step; `PairAlgorithm`:
the pair step), never from its name.

The names below load on first use (PEP 562): the algorithm objects import torch, and
`posttrain validate` imports this package's light checks (`teacher.py`) without them.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...config import Recipe
    from .base import Algorithm, PairAlgorithm, RLAlgorithm

# algorithm name -> (module, class)
_CLASSES = {
    "grpo": ("grpo", "GRPO"),
    "ppo": ("ppo", "PPO"),
    "dpo": ("dpo", "DPO"),
    "reward_model": ("reward_model", "RewardModel"),
    "distill": ("distill", "Distill"),
    "sft": ("sft", "SFT"),
}

__all__ = ["ALGORITHMS", "Algorithm", "PairAlgorithm", "RLAlgorithm", "algorithm_for"]


def _registry() -> dict[str, type[Algorithm]]:
    return {
        name: getattr(import_module(f"{__name__}.{mod}"), cls)
        for name, (mod, cls) in _CLASSES.items()
    }


def __getattr__(name: str) -> Any:
    if name in ("Algorithm", "PairAlgorithm", "RLAlgorithm"):
        return getattr(import_module(f"{__name__}.base"), name)
    if name == "ALGORITHMS":
        return _registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def algorithm_for(recipe: Recipe) -> Algorithm:
    """The algorithm object of `recipe.algorithm`.

    Raises:
        KeyError: an algorithm the schema accepts but no object implements.
    """
    mod, cls = _CLASSES[recipe.algorithm]
    return getattr(import_module(f"{__name__}.{mod}"), cls)(recipe)
