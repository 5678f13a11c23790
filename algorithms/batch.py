"""The train batch: controller → learner, and what every algorithm's loss reads.

Layout of one row: `[left pad | prompt | response | right pad]`. Every prompt is
left-padded to the same width, so all responses start at column `response_start`;
the learner then computes logits only for the response columns (the 49k-wide LM
head dominates a small model's cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch


@dataclass
class TrainBatch:
    """Padded tensors of one step (or one rank's shard of it).

    Attributes:
        input_ids: `[B, T]` prompt + response token ids, pads anywhere masked out.
        attention_mask: `[B, T]` 1 on real tokens, 0 on padding.
        response_mask: `[B, T]` 1 on tokens the loss counts (response tokens of rows
            whose reward was scored); 0 elsewhere.
        response_start: first response column (= prompt width after left padding).
        old_logprobs: `[B, T]` policy logprobs before this step's update (0 off-mask).
        ref_logprobs: `[B, T]` frozen reference logprobs, or None when KL is off.
        advantages: `[B, T]` per-token advantages (GRPO: the sequence's, broadcast).
        inference_logprobs: `[B, T]` the rollout engine's logprobs, for diagnostics.
        returns: `[B, T]` PPO value targets (GAE returns).
        values: `[B, T]` the critic's values before the update (PPO value clipping).
        ref_sums: `[B]` the reference's summed response logprobs per row (DPO, when
            precomputed), or None.
        margins: `[B]` each preference pair's Bradley-Terry margin on both its rows
            (reward model, Llama 2's margin), or None.
        segment_ids: `[B, T]` long, for rows that pack several examples (SFT): k ≥ 1 on
            the tokens of the row's k-th example, 0 on padding. Each example then gets
            its own position ids (0, 1, ...) and attends to itself only
            (`learner.logprobs.segment_attention`). None: one example per row.
        loss_denominator: the step-wide normaliser of the loss (tokens, sequences or
            pairs of the whole step over all ranks; see `algorithms.common`), so
            micro-batch size and rank count cannot change the loss.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    response_start: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    inference_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None
    ref_sums: torch.Tensor | None = None
    margins: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    loss_denominator: float = 1.0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> TrainBatch:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = fn(v) if isinstance(v, torch.Tensor) else v
        return replace(self, **out)

    def to(self, device: torch.device) -> TrainBatch:
        """Every tensor on `device` (the same batch when already there)."""
        return self if device.type == "cpu" else self._map(lambda t: t.to(device))

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        """Rows `rows` of every tensor."""
        return self._map(lambda t: t[rows])

    def shard(self, rank: int, world: int) -> TrainBatch:
        """Contiguous 1/world of the rows; `len(self)` must be a multiple of `world`.

        Raises:
            ValueError: the batch does not split evenly (FSDP ranks must run the same
                number of micro-batches, or the collectives hang).
        """
        if len(self) % world:
            raise ValueError(f"batch of {len(self)} rows does not split over {world} ranks")
        per = len(self) // world
        return self.select(slice(rank * per, (rank + 1) * per))


def pack_rows(
    rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`(prompt_ids, response_ids)` rows into the layout above.

    Returns:
        input_ids `[B, T]`, attention_mask `[B, T]`, response_mask `[B, T]` (float, 1 on
        every response token) and response_start (the common prompt width).
    """
    width_p = max(len(p) for p, _ in rows)
    width_r = max(max(len(r) for _, r in rows), 1)
    ids = torch.full((len(rows), width_p + width_r), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (p, r) in enumerate(rows):
        ids[i, width_p - len(p) : width_p] = torch.tensor(list(p), dtype=torch.long)
        ids[i, width_p : width_p + len(r)] = torch.tensor(list(r), dtype=torch.long)
        attn[i, width_p - len(p) : width_p + len(r)] = 1
        resp[i, width_p : width_p + len(r)] = 1.0
    return ids, attn, resp, width_p


def pad_rows_to_multiple(batch: TrainBatch, multiple: int) -> TrainBatch:
    """Append copies of row 0 with an all-zero response mask until the row count is a
    multiple of `multiple`. The copies add nothing to any loss or metric."""
    extra = (-len(batch)) % multiple
    if extra == 0:
        return batch

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[:1].expand(extra, *t.shape[1:])], dim=0)

    grown = batch._map(grow)
    grown.response_mask[len(batch) :] = 0
    return grown


def concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows of several shards back into one `[B, T]` tensor (inverse of `shard`)."""
    return torch.cat(list(parts), dim=0)
