"""An example verifiers 0.4 (`verifiers.v1`) taskset, written to its public API: sums of
two whole numbers, each task's reward functions checking the model's last reply.

Rewards (`@vf.reward`, each a reward component in posttrain's metrics): `correct` (1
when the last number in the reply is the sum, weight 1) and `short` (1 when the reply
has at most 40 characters, weight 0.1).

Run it with posttrain (docs/multi-turn.md, "verifiers environments"), the harness being
verifiers' own tool-less chat loop (`null`), its model calls served by the rollout
workers:

    rollout:
      environment:
        type: verifiers
        api: v1
        module: vf1_sums                 # this file on PYTHONPATH (the taskset id)
        args: {num_tasks: 64}            # the taskset config's fields
        harness: {id: "null"}
        python: .venv-vf1/bin/python     # scripts/vf1_venv.sh: verifiers>=0.4
    data:
      train: {environment: train}

Or with verifiers alone: `vf-eval vf1_sums --env.agent.harness.id null`.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

__all__ = ["SumsTaskset"]


class SumsData(vf.TaskData):
    """One sum: its operands and the answer."""

    a: int
    b: int
    answer: int


class SumsTask(vf.Task[SumsData]):
    """Scores the model's last reply against the task's answer."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return float(len((trace.last_reply or "").strip()) <= 40)


class SumsConfig(vf.TasksetConfig):
    """`num_tasks` sums of numbers from 1 to `max_operand`, drawn with `seed`."""

    num_tasks: int = 32
    max_operand: int = 20
    seed: int = 0


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    """The sums, in a fixed order for a seed."""

    def load(self) -> list[SumsTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(1, self.config.max_operand), rng.randint(1, self.config.max_operand)
            data = SumsData(
                prompt=f"What is {a} + {b}? Reply with the number only.",
                a=a,
                b=b,
                answer=a + b,
            )
            tasks.append(SumsTask(data, self.config.task))
        return tasks
