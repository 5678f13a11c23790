"""Supervised fine-tuning as pure tensor functions: the next-token cross-entropy of the
assistant tokens (the loss of every SFT trainer: TRL's `SFTTrainer` with
`assistant_only_loss`, torchtune, verl), and the packing of short conversations into
rows.

Loss: −Σ_t mask_t · log π(x_t | x_<t) / N, N the assistant tokens of the whole step
(`TrainBatch.loss_denominator`), so micro-batch size, rank count and packing cannot
change it. A packed row holds several conversations, each with its own positions and
no attention across them (`TrainBatch.segment_ids`), so its logprobs equal those of the
conversation alone (tests/algorithms/test_sft.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import TrainBatch
from .common import LossOutput, ratio_of

#: Rows of one example (one packed row, or one conversation).
ROWS_PER_EXAMPLE = 1


@dataclass(frozen=True)
class SFTLoss:
    """Settings of the SFT loss: none beyond the batch (kept for the shared signature)."""


def token_mean_nll(logprobs: torch.Tensor, mask: torch.Tensor, denominator: float) -> torch.Tensor:
    """−Σ logprobs·mask / denominator: the mean negative log-likelihood of the masked
    tokens when `denominator` is their count. `[B, T]` in, a scalar out.

    Raises:
        ValueError: shapes differ or `denominator` ≤ 0.
    """
    if logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} differ")
    if denominator <= 0:
        raise ValueError(f"loss denominator {denominator} must be > 0 (assistant tokens)")
    return -(logprobs * mask).sum() / denominator


def loss(
    logprobs: torch.Tensor, mb: TrainBatch, cfg: SFTLoss, values: torch.Tensor | None = None
) -> LossOutput:
    """The SFT loss of one micro-batch.

    Args:
        logprobs: `[b, T]` policy logprobs with gradients (0 before `response_start`).
        mb: `response_mask [b, T]` (1 on assistant tokens) and `loss_denominator` (the
            step's assistant tokens over all ranks).
        values: unused.
    """
    m = mb.response_mask.to(logprobs.dtype)
    total = token_mean_nll(logprobs, m, mb.loss_denominator)
    return LossOutput(
        total,
        {
            "loss": float(total.detach()),
            "nll_sum": float(-(logprobs.detach() * m).sum()),
            "assistant_tokens": float(m.sum()),
        },
    )


def finish_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Step metrics: the loss (mean NLL per assistant token) and the tokens trained on."""
    return {
        "loss": ratio_of(sums, "nll_sum", "assistant_tokens"),
        "sft/assistant_tokens": sums.get("assistant_tokens", 0.0),
    }


@dataclass
class PackedRows:
    """Conversations laid out in rows (right padding).

    Attributes:
        input_ids: `[B, T]`.
        attention_mask: `[B, T]` 1 on real tokens.
        response_mask: `[B, T]` float, 1 on assistant tokens (never an example's first).
        segment_ids: `[B, T]` k ≥ 1 on a row's k-th example, 0 on padding; None when each
            row holds one example (`pack=False`).
        placement: for each example, `(row, first column)`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    segment_ids: torch.Tensor | None
    placement: list[tuple[int, int]]

    def batch(self) -> TrainBatch:
        """As a `TrainBatch` whose logprobs are wanted from column 1 on."""
        return TrainBatch(
            self.input_ids,
            self.attention_mask,
            self.response_mask,
            1,
            segment_ids=self.segment_ids,
        )


def _balanced_rows(lengths: list[int], max_length: int, multiple: int) -> list[list[int]]:
    """Example indices per row: the fewest rows, a multiple of `multiple`, whose
    longest-first, least-filled-row-next assignment (LPT) keeps every row within
    `max_length`; balanced rows keep the padding to the widest one small."""
    total = sum(lengths)
    n = max(1, -(-total // max_length))
    n = -(-n // multiple) * multiple
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    while True:
        rows: list[list[int]] = [[] for _ in range(n)]
        used = [0] * n
        for i in order:
            r = min(range(n), key=lambda r: used[r])
            rows[r].append(i)
            used[r] += lengths[i]
        if max(used) <= max_length:
            return [r for r in rows if r] or rows[:1]
        n += multiple


def pack_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    max_length: int,
    pack: bool = True,
    rows_multiple: int = 1,
) -> PackedRows:
    """Lay `(ids, mask)` examples into rows.

    pack: the fewest rows (a multiple of `rows_multiple`, e.g. the learner ranks, so no
    rank computes a padding copy) of at most `max_length` tokens, filled longest example
    first into the least-filled row (balanced rows: little right padding). Otherwise one
    example per row, in order.

    Args:
        examples: token ids and their 0/1 assistant mask, each of at most `max_length`.
        pad_id: the pad token.
        max_length: the most tokens of one row.
        rows_multiple: packed rows come in multiples of it (when there are that many
            examples).

    Raises:
        ValueError: no examples, an example longer than `max_length` or with a mask of
            another length.
    """
    if not examples:
        raise ValueError("pack_examples needs at least one example")
    for i, (ids, mask) in enumerate(examples):
        if len(ids) != len(mask) or not 2 <= len(ids) <= max_length:
            raise ValueError(
                f"example {i}: {len(ids)} ids and {len(mask)} mask values; both must be "
                f"equal, at least 2 and at most {max_length}"
            )
    lengths = [len(e[0]) for e in examples]
    if pack:
        rows = _balanced_rows(lengths, max_length, min(rows_multiple, len(examples)))
    else:
        rows = [[i] for i in range(len(examples))]
    width = max(sum(lengths[i] for i in r) for r in rows)
    ids_t = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids_t)
    resp = torch.zeros(ids_t.shape, dtype=torch.float32)
    seg = torch.zeros_like(ids_t)
    placement: list[tuple[int, int]] = [(0, 0)] * len(examples)
    for r, members in enumerate(rows):
        col = 0
        for k, i in enumerate(members, start=1):
            ids, mask = examples[i]
            n = len(ids)
            ids_t[r, col : col + n] = torch.tensor(list(ids), dtype=torch.long)
            attn[r, col : col + n] = 1
            resp[r, col + 1 : col + n] = torch.tensor(list(mask[1:]), dtype=torch.float32)
            seg[r, col : col + n] = k
            placement[i] = (r, col)
            col += n
    return PackedRows(ids_t, attn, resp, seg if pack else None, placement)
