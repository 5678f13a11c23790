"""Rows packed for the learner's forward: the samples of one prompt packed into one
sequence behind a single copy of the prompt (`packed_prompts`, when it pays), and
several examples packed into one row (`segment_attention`, SFT's packing). Both only
change which tokens attend to which: the logprobs equal the unpacked ones to float
rounding (tests/learner/test_logprobs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.packing import packing_pays


def shared_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_columns: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows whose first `prompt_columns` columns (ids and mask) are identical, as a GRPO
    group's G samples of one prompt are.

    Args:
        input_ids, attention_mask: `[B, T]`.
        prompt_columns: leading columns compared (the left-padded prompt).

    Returns:
        `(first, inverse)`: `[U]` the first row of each distinct prompt and `[B]` each
        row's index into `first`; None when no two rows share a prompt.
    """
    key = torch.cat(
        [input_ids[:, :prompt_columns], attention_mask[:, :prompt_columns].to(input_ids.dtype)],
        dim=1,
    )
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1
    if distinct == input_ids.shape[0]:
        return None
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    first = torch.full((distinct,), input_ids.shape[0], device=input_ids.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


@dataclass(frozen=True)
class PromptPacking:
    """Rows sharing a prompt packed into one sequence each: `[prompt | response 1 | ... |
    response G]`, every response attending to the prompt and to itself only.

    Attributes:
        input_ids, positions: `[U, L]`, L = P + G·R (G: the largest group; a smaller
            group's unused blocks are masked out).
        mask: `[U, 1, L, L]` bool, True where a query column may attend to a key column.
        rows, columns: `[B, R]` where, in the head's `[U, L − P + 1]` hidden states (the
            packed columns from P − 1 on), the state predicting each original row's
            response token sits.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor

    @staticmethod
    def build(
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        prompt: int,
        first: torch.Tensor,
        inverse: torch.Tensor,
    ) -> PromptPacking:
        """Pack `[B, T]` rows whose first `prompt` columns are shared (`shared_prompts`)."""
        b, t = input_ids.shape
        r, dev = t - prompt, input_ids.device
        slot = torch.zeros(b, dtype=torch.long, device=dev)  # a row's block in its group
        for u in range(first.shape[0]):
            members = (inverse == u).nonzero().squeeze(-1)
            slot[members] = torch.arange(members.shape[0], device=dev)
        g = int(slot.max()) + 1
        u_count, length = first.shape[0], prompt + g * r
        ids = torch.zeros(u_count, length, dtype=input_ids.dtype, device=dev)
        pos = torch.zeros(u_count, length, dtype=positions.dtype, device=dev)
        valid = torch.zeros(u_count, length, dtype=torch.bool, device=dev)
        block = torch.zeros(u_count, length, dtype=torch.long, device=dev)
        ids[:, :prompt], pos[:, :prompt] = input_ids[first, :prompt], positions[first, :prompt]
        valid[:, :prompt] = attention_mask[first, :prompt].bool()
        cols = prompt + slot[:, None] * r + torch.arange(r, device=dev)  # [B, R]
        rows = inverse[:, None].expand(b, r)
        ids[rows, cols], pos[rows, cols] = input_ids[:, prompt:], positions[:, prompt:]
        valid[rows, cols] = attention_mask[:, prompt:].bool()
        block[rows, cols] = slot[:, None] + 1
        q = torch.arange(length, device=dev)
        same = (block[:, None, :] == 0) | (block[:, None, :] == block[:, :, None])
        allowed = same & valid[:, None, :] & (q[None, None, :] <= q[None, :, None])
        allowed |= torch.eye(length, dtype=torch.bool, device=dev)  # no empty softmax row
        # Kept hidden states start at packed column P − 1 (the prompt's last), which
        # predicts every response's first token; then response column c predicts c + 1.
        head_cols = torch.cat(
            [torch.zeros(b, 1, dtype=torch.long, device=dev), cols[:, :-1] - prompt + 1], dim=1
        )
        return PromptPacking(ids, pos, allowed[:, None], rows, head_cols)


def segment_attention(
    segment_ids: torch.Tensor, additive_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and attention mask of rows that pack several examples.

    Args:
        segment_ids: `[B, T]` long: k ≥ 1 on the row's k-th example, 0 on padding.
        additive_dtype: None: a boolean mask (SDPA's: True where a query may attend to a
            key); a float dtype: the additive mask eager attention adds (0 / the dtype's
            minimum).

    Returns:
        positions `[B, T]` (0, 1, ... from each example's first token; 0 on padding) and
        mask `[B, 1, T, T]`: causal within an example, nothing across examples, and every
        padding query attends to itself (no softmax over nothing).
    """
    b, t = segment_ids.shape
    dev = segment_ids.device
    col = torch.arange(t, device=dev).expand(b, t)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, col, torch.zeros_like(col)).cummax(-1).values
    positions = torch.where(segment_ids > 0, col - first, torch.zeros_like(col))
    same = segment_ids[:, None, :] == segment_ids[:, :, None]
    real = (segment_ids > 0)[:, None, :]
    causal = col[:, None, :] <= col[:, :, None]
    allowed = (same & real & causal) | torch.eye(t, dtype=torch.bool, device=dev)
    if additive_dtype is None:
        return positions, allowed[:, None]
    mask = torch.zeros(allowed.shape, dtype=additive_dtype, device=dev)
    mask.masked_fill_(~allowed, torch.finfo(additive_dtype).min)
    return positions, mask[:, None]


def packed_prompts(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    prompt: int,
) -> PromptPacking | None:
    """The packing of this micro-batch, or None where it is not taken: no shared prompt,
    an attention other than SDPA (a boolean 4-D mask is SDPA's), or too little gain."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    groups = shared_prompts(input_ids, attention_mask, prompt)
    if groups is None:
        return None
    first, inverse = groups
    g = int(torch.bincount(inverse).max())
    b, t = input_ids.shape
    h = getattr(config, "hidden_size", None)
    if h is None or not packing_pays(
        b, t, prompt, first.shape[0], g, h, getattr(config, "intermediate_size", None) or 4 * h
    ):
        return None
    return PromptPacking.build(input_ids, attention_mask, positions, prompt, first, inverse)
