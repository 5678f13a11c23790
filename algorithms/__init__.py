"""The math of each algorithm, pure torch, one module per algorithm.

Each of `grpo`, `ppo`, `dpo`, `reward_model` and `sft` holds its advantage estimator (GRPO,
PPO) and one loss with the shared signature

    loss(logprobs [b, T], micro_batch: TrainBatch, cfg, values [b, T] | None) -> LossOutput

(`reward_model` reads `[b]` scalar scores in place of logprobs: its `MODEL_OUTPUT`),
plus `finish_metrics(sums) -> metrics`, which turns the loss's summed numerators into
step metrics (`distill`, on-policy distillation, holds its advantages and trains with
GRPO's loss). The learner runs one train-step skeleton with the loss chosen at setup
(`loss_module`); the controller's algorithm object (recipes/algo/base.py) builds the
batch. A new loss is one function here, one schema entry and its tests.
"""

from __future__ import annotations

from types import ModuleType


def loss_module(name: str) -> ModuleType:
    """The module holding algorithm `name`'s `loss` and `finish_metrics`.

    Raises:
        ValueError: an unknown algorithm.
    """
    from . import dpo, grpo, ppo, reward_model, sft

    modules = {"grpo": grpo, "ppo": ppo, "dpo": dpo, "reward_model": reward_model, "sft": sft}
    modules["distill"] = grpo  # distillation trains with GRPO's policy-gradient loss
    if name not in modules:
        raise ValueError(f"unknown algorithm {name!r}; one of {sorted(modules)}")
    return modules[name]
