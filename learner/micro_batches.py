"""How a learner rank splits its shard into micro-batches: fixed row counts (today's
default) or a token budget.

Token budget (`train.max_tokens_per_micro_batch`): whole examples (a DPO pair is two
rows) are sorted by real length, longest first, and packed greedily so each
micro-batch holds at most that many real tokens; an example longer than the budget
gets a micro-batch of its own. Each micro-batch then drops the padding columns on its
right: `response_start` stays the common first response column, so left padding
cannot be cut. The loss does not change, since every loss divides by the step-wide
`TrainBatch.loss_denominator`, never by a micro-batch's own count.

Limits: the budget counts real tokens, not the padded rectangle a micro-batch
computes; sorting by length keeps the two close. All FSDP ranks must run the same
number of micro-batches (each forward gathers shards), so `plan_rows` takes
`at_least` and splits its largest groups until it has that many.
"""

from __future__ import annotations

import torch

from ..algorithms.batch import TrainBatch


def plan_rows(
    attention_mask: torch.Tensor,
    unit: int,
    micro_batch_size: int,
    max_tokens: int | None,
    at_least: int = 1,
) -> list[torch.Tensor]:
    """Row indices of each micro-batch.

    Args:
        attention_mask: `[B, T]` 1 on real tokens.
        unit: rows per example, kept together (1; DPO: 2).
        micro_batch_size: rows per micro-batch when `max_tokens` is None (rounded up
            to whole examples).
        max_tokens: real tokens per micro-batch, or None for fixed sizes.
        at_least: split the largest groups until there are this many (at most the
            number of examples).

    Returns:
        one `[b]` long tensor per micro-batch; every row appears exactly once.
    """
    n = attention_mask.shape[0]
    examples = [torch.arange(i, min(i + unit, n)) for i in range(0, n, unit)]
    if max_tokens is None:
        per = -(-micro_batch_size // unit)
        groups = [list(range(i, min(i + per, len(examples)))) for i in range(0, len(examples), per)]
    else:
        lengths = attention_mask.sum(-1)
        tokens = [int(lengths[e].sum()) for e in examples]
        groups, current, used = [], [], 0
        for i in sorted(range(len(examples)), key=lambda i: -tokens[i]):
            if current and used + tokens[i] > max_tokens:
                groups.append(current)
                current, used = [], 0
            current.append(i)
            used += tokens[i]
        groups.append(current)
    while len(groups) < min(at_least, len(examples)):
        big = max(range(len(groups)), key=lambda g: len(groups[g]))
        half = len(groups[big]) // 2
        groups[big : big + 1] = [groups[big][:half], groups[big][half:]]
    return [torch.cat([examples[i] for i in g]) for g in groups]


def trim_right_padding(mb: TrainBatch) -> TrainBatch:
    """The micro-batch without the all-padding columns after its last real token
    (keeping at least one response column)."""
    width = mb.input_ids.shape[1]
    cols = torch.arange(width).expand_as(mb.attention_mask)
    last = torch.where(mb.attention_mask > 0, cols, torch.zeros_like(cols)).max()
    keep = max(int(last) + 1, mb.response_start + 1)
    if keep >= width:
        return mb
    return mb._map(lambda t: t[:, :keep] if t.dim() == 2 and t.shape[1] == width else t)
