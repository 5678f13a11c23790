"""When packing the rows that share a prompt into one sequence pays (learner/logprobs.py
does the packing; `plan --gpu cpu` counts the tokens the learner then computes). No torch.

A GRPO group's G samples repeat one prompt of P tokens; row by row the learner computes
G·(P + R) tokens, packed `[prompt | response 1 | ... | response G]` only P + G·R. The
attention of the packed row is dense over its length (SDPA with a mask computes the
masked scores too), so long responses can make packing cost more than it saves.
"""

from __future__ import annotations


def forward_cost(rows: int, length: int, hidden: int, intermediate: int) -> float:
    """Relative FLOPs of one forward over `[rows, length]`, per layer: the linear layers,
    ∝ tokens·h·(4h + 3i) (q, k, v, o and a gated MLP), plus dense attention scores and
    their weighted sum, ∝ 2·h·rows·length² (Kaplan et al. 2020, Table 1)."""
    return rows * length * hidden * (4 * hidden + 3 * intermediate) + 2 * hidden * rows * length**2


def packing_pays(
    rows: int, length: int, prompt: int, prompts: int, group: int, hidden: int, intermediate: int
) -> bool:
    """Whether packing `rows` rows of `length` columns (the first `prompt` shared, in
    `prompts` distinct prompts of at most `group` rows each) into `prompts` rows of
    `prompt + group·(length − prompt)` columns cuts the forward's FLOPs by ≥ 10%."""
    packed = forward_cost(prompts, prompt + group * (length - prompt), hidden, intermediate)
    return packed < 0.9 * forward_cost(rows, length, hidden, intermediate)
