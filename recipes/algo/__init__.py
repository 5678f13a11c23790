"""The algorithm objects on the controller, one module per algorithm, and their registry.

`base.py` knows no subclass; the loop looks an algorithm up once (`algorithm_for`) and
picks its step from the object's kind (`RLAlgorithm`: the rollout step; `PairAlgorithm`:
the pair step), never from its name.
"""

from __future__ import annotations

from ...config import Recipe
from .base import Algorithm, PairAlgorithm, RLAlgorithm
from .distill import Distill
from .dpo import DPO
from .grpo import GRPO
from .ppo import PPO
from .reward_model import RewardModel
from .sft import SFT

ALGORITHMS: dict[str, type[Algorithm]] = {
    "grpo": GRPO,
    "ppo": PPO,
    "dpo": DPO,
    "reward_model": RewardModel,
    "distill": Distill,
    "sft": SFT,
}

__all__ = ["ALGORITHMS", "Algorithm", "PairAlgorithm", "RLAlgorithm", "algorithm_for"]


def algorithm_for(recipe: Recipe) -> Algorithm:
    """The algorithm object of `recipe.algorithm`.

    Raises:
        KeyError: an algorithm the schema accepts but no object implements.
    """
    return ALGORITHMS[recipe.algorithm](recipe)
