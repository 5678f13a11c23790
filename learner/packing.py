"""Rows packed for the learner's forward: the samples of one prompt packed into one
sequence behind a single copy of the prompt (`packed_prompts`, when it pays), and
several examples packed into one row (`segment_attention`, SFT's packing). Both only
change which tokens attend to which: the logprobs equal the unpacked ones to float
rounding (tests/learner/test_logprobs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..common.packing import packing_pays
from .attention import causal_attention


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
    response G]`, every response attending to the prompt and to itself only. Each
    response keeps its real tokens only (a response's right padding is not packed), so
    a group's sequence is as long as its prompt and its responses' real tokens.

    Attributes:
        input_ids, positions: `[U, L]`, L = P + the most real response tokens of a
            group (columns after a shorter group's last token are masked out).
        mask: `[U, 1, L, L]` bool, True where a query column may attend to a key column.
        rows, columns: `[B, R]` where, in the head's `[U, L − P + 1]` hidden states (the
            packed columns from P − 1 on), the state predicting each original row's
            response token sits; on a response's padding they point at column 0 (its
            value there is not a logprob of anything: `real` says which are).
        real: `[B, R]` bool, the response columns that hold real tokens.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    real: torch.Tensor

    @staticmethod
    def build(
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        prompt: int,
        first: torch.Tensor,
        inverse: torch.Tensor,
    ) -> PromptPacking:
        """Pack `[B, T]` rows whose first `prompt` columns are shared (`shared_prompts`).
        A response's real tokens are the first of its columns (right padding only:
        `right_padded_responses`)."""
        b, t = input_ids.shape
        r, dev = t - prompt, input_ids.device
        real = attention_mask[:, prompt:].bool()  # [B, R]
        lengths = real.sum(-1)
        start = torch.zeros(b, dtype=torch.long, device=dev)  # a row's first packed column
        block_of = torch.zeros(b, dtype=torch.long, device=dev)  # its block in its group
        used = []
        for u in range(first.shape[0]):
            members = (inverse == u).nonzero().squeeze(-1)
            ends = lengths[members].cumsum(0)
            start[members] = prompt + ends - lengths[members]
            block_of[members] = torch.arange(1, members.shape[0] + 1, device=dev)
            used.append(int(ends[-1]) if members.numel() else 0)
        u_count, length = first.shape[0], prompt + max(used)
        ids = torch.zeros(u_count, length, dtype=input_ids.dtype, device=dev)
        pos = torch.zeros(u_count, length, dtype=positions.dtype, device=dev)
        valid = torch.zeros(u_count, length, dtype=torch.bool, device=dev)
        block = torch.zeros(u_count, length, dtype=torch.long, device=dev)
        ids[:, :prompt], pos[:, :prompt] = input_ids[first, :prompt], positions[first, :prompt]
        valid[:, :prompt] = attention_mask[first, :prompt].bool()
        cols = start[:, None] + torch.arange(r, device=dev)  # [B, R]; valid where real
        rows = inverse[:, None].expand(b, r)
        at = (rows[real], cols[real])
        ids[at], pos[at] = input_ids[:, prompt:][real], positions[:, prompt:][real]
        valid[at] = True
        block[at] = block_of[:, None].expand(b, r)[real]
        q = torch.arange(length, device=dev)
        same = (block[:, None, :] == 0) | (block[:, None, :] == block[:, :, None])
        allowed = same & valid[:, None, :] & (q[None, None, :] <= q[None, :, None])
        allowed |= torch.eye(length, dtype=torch.bool, device=dev)  # no empty softmax row
        # Kept hidden states start at packed column P − 1 (the prompt's last), which
        # predicts every response's first token; then response column c predicts c + 1.
        head_cols = torch.cat(
            [torch.zeros(b, 1, dtype=torch.long, device=dev), cols[:, :-1] - prompt + 1], dim=1
        )
        head_cols = torch.where(real, head_cols, torch.zeros_like(head_cols))
        return PromptPacking(ids, pos, allowed[:, None], rows, head_cols, real)


def right_padded_responses(attention_mask: torch.Tensor, prompt: int) -> bool:
    """Whether every row's response columns (from `prompt` on) are its real tokens
    followed by padding only, as sampled responses are (`[B, T]` mask)."""
    resp = attention_mask[:, prompt:].long()
    return bool((resp[:, 1:] <= resp[:, :-1]).all())


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """`[B, T]` position ids of packed rows: 0, 1, ... from each example's first token,
    0 on padding (`segment_ids` as in `segment_attention`)."""
    b, t = segment_ids.shape
    col = torch.arange(t, device=segment_ids.device).expand(b, t)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, col, torch.zeros_like(col)).cummax(-1).values
    return torch.where(segment_ids > 0, col - first, torch.zeros_like(col))


def segment_runs(segment_ids: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal `segment_ids` over the rows laid end to end (a run
    never crosses a row's end): each example is one run, each stretch of padding one.

    Args:
        segment_ids: `[B, T]` as in `segment_attention`.

    Returns:
        run lengths in row-major order, summing to B·T.
    """
    b, t = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    at = starts.reshape(-1).nonzero().squeeze(-1)
    return torch.diff(at, append=at.new_tensor([b * t])).tolist()


#: The name `segment_sdpa` is registered under in transformers' `AttentionInterface`.
SEGMENT_ATTENTION = "posttrain_segments"


def run_buckets(runs: list[int], ratio: float = 2**0.5) -> list[list[int]]:
    """The runs grouped for padded attention calls: sorted longest first, a bucket keeps
    the runs no shorter than its longest / `ratio`, so padding each to the bucket's
    longest computes at most `ratio`² the score pairs each run needs.

    Returns:
        lists of indices into `runs`, longest bucket first.
    """
    order = sorted(range(len(runs)), key=lambda i: -runs[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and runs[i] * ratio >= runs[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def _bucket_index(runs: list[int], device: torch.device) -> tuple[list, torch.Tensor]:
    """Per bucket (`run_buckets`) the `[n, L]` token index of its runs, padded with each
    run's own last token (computed, never read back), and the `[sum(runs)]` index of
    each token in the buckets' outputs laid end to end."""
    starts = [0]
    for n in runs[:-1]:
        starts.append(starts[-1] + n)
    where = torch.empty(sum(runs), dtype=torch.long)
    index, offset = [], 0
    for bucket in run_buckets(runs):
        width = runs[bucket[0]]
        col = torch.arange(width)
        start = torch.tensor([starts[i] for i in bucket])[:, None]
        size = torch.tensor([runs[i] for i in bucket])[:, None]
        index.append((start + torch.minimum(col, size - 1)).to(device))
        for row, i in enumerate(bucket):
            at = offset + row * width
            where[starts[i] : starts[i] + runs[i]] = torch.arange(at, at + runs[i])
        offset += len(bucket) * width
    return index, where.to(device)


def segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    segment_runs: list[int] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA within each run of a packed row only: the attention of
    `segment_attention`'s block mask without its masked blocks (a row of k examples of
    length L computes about L²/k score pairs, not L²). The runs are gathered into a few
    padded batches of similar lengths (`run_buckets`), one causal attention call each
    (`learner/attention.py` `causal_attention`; right padding: no real query sees a
    padded key), and gathered back. A transformers
    attention function (`AttentionInterface`); the runs come in as the model call's
    `segment_runs` keyword.

    Args:
        query: `[B, H, T, D]`; key, value: `[B, H_kv, T, D]` (H a multiple of H_kv).
        attention_mask: must be None (the runs are the mask).
        segment_runs: `segment_runs(segment_ids)`.

    Returns:
        (`[B, T, H, D]` attention output, None). A padding run attends causally within
        itself (finite; its positions are never read).

    Raises:
        ValueError: no `segment_runs`, a mask as well, runs not summing to B·T, or a
            layer that asks for a sliding window, logit soft-capping or attention sinks.
    """
    b, h, t, d = query.shape
    if segment_runs is None or attention_mask is not None or sum(segment_runs) != b * t:
        raise ValueError(
            "segment attention needs `segment_runs` summing to the batch's tokens and no mask"
        )
    unknown = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if unknown:  # plain causal SDPA would drop them: a silently different attention
        raise ValueError(
            f"segment attention computes plain causal attention; this layer asks for "
            f"{unknown}: load the model with attn_implementation='eager' for packed rows"
        )
    index, where = _bucket_index(segment_runs, query.device)
    # token-major [B·T, heads, D]; k and v keep their H_kv heads (SDPA's enable_gqa)
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    out = []
    for idx in index:
        n, width = idx.shape
        # [n, heads, L, D]; index_select's backward is one index_add
        qs, ks, vs = (
            x.index_select(0, idx.view(-1)).view(n, width, -1, d).transpose(1, 2) for x in (q, k, v)
        )
        o = causal_attention(qs, ks, vs, scale=scaling, dropout=dropout)
        out.append(o.transpose(1, 2).reshape(n * width, h, d))
    flat = out[0] if len(out) == 1 else torch.cat(out)
    return flat.index_select(0, where).view(b, t, h, d), None


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether any module recomputes its forward in backward (gradient checkpointing):
    the recompute would not see a temporarily switched attention."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@contextmanager
def segment_attention_on(config) -> Iterator[None]:
    """`segment_sdpa` as the model's attention for the forwards inside (the config's
    `_attn_implementation`, read by each attention layer at each call), then back; it
    needs no mask, so transformers builds none."""
    from transformers import AttentionInterface

    if SEGMENT_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(SEGMENT_ATTENTION, segment_sdpa)
    old = config._attn_implementation
    config._attn_implementation = SEGMENT_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = old


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
    positions = segment_positions(segment_ids)
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
    if not right_padded_responses(attention_mask, prompt):
        return None
    return PromptPacking.build(input_ids, attention_mask, positions, prompt, first, inverse)
