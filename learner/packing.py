"""Rows packed for the learner's forward: the samples of one prompt packed into one
sequence behind a single copy of the prompt (`packed_prompts`, when it pays), and
several examples packed into rows (SFT's packing: laid end to end without padding,
`PaddingFree`, or under `segment_attention`'s block mask). Both only change which
tokens attend to which: the logprobs equal the unpacked ones to float rounding
(tests/learner/test_logprobs.py, tests/learner/test_segment_attention.py)."""

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

    def call(self, response_start: int) -> dict:
        """The model call's keywords (hidden states kept from packed column P − 1 on)."""
        return dict(
            input_ids=self.input_ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            logits_to_keep=self.input_ids.shape[1] - response_start + 1,
            use_cache=False,
        )


@dataclass(frozen=True)
class PaddingFree:
    """Rows that pack several examples laid end to end without their padding: one
    `[1, N]` row of the N real tokens, each example one run of `segment_sdpa` (padding-
    free packing, as flash-attention's varlen kernels and TRL's `padding_free` do). No
    projection, norm or attention then runs on a padding token; every real token's
    hidden state is that of the padded layout (attention stays within its example).

    Attributes:
        input_ids, positions: `[1, N]`.
        runs: the examples' lengths in order (`segment_runs` of the flat row).
        rows, columns: `[B, R]` (R = T − `response_start`): where in the `[1, N]` hidden
            states sits the state predicting each response column (column c + 1 is
            predicted from column c); 0 where `real` is False.
        real: `[B, R]` bool, the response columns that are real tokens predicted from a
            real token.
        blocks: None (each run causal), or `[N]` for `PackedGroups`' runs.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    runs: list[int]
    rows: torch.Tensor
    columns: torch.Tensor
    real: torch.Tensor
    blocks: torch.Tensor | None = None

    @staticmethod
    def build(
        input_ids: torch.Tensor, segment_ids: torch.Tensor, response_start: int
    ) -> PaddingFree:
        """From `[B, T]` ids and `segment_ids` (k ≥ 1 on a row's k-th example, 0 on
        padding; an example's tokens contiguous)."""
        b, t = segment_ids.shape
        keep = (segment_ids > 0).reshape(-1)
        at = keep.nonzero().squeeze(-1)  # [N] flat index of each real token
        # one id per (row, example): a row's last example and the next row's first stay apart
        rowwise = segment_ids + (t + 1) * torch.arange(b, device=segment_ids.device)[:, None]
        ids = rowwise.reshape(-1)[at][None]
        where = torch.zeros(b * t, dtype=torch.long, device=segment_ids.device)
        where[at] = torch.arange(at.shape[0], device=segment_ids.device)
        where = where.view(b, t)
        real = (segment_ids[:, response_start:] > 0) & (segment_ids[:, response_start - 1 : -1] > 0)
        columns = torch.where(real, where[:, response_start - 1 : -1], 0)
        return PaddingFree(
            input_ids.reshape(-1)[at][None],
            segment_positions(ids),
            segment_runs(ids),
            torch.zeros_like(columns),
            columns,
            real,
        )

    def call(self, response_start: int) -> dict:  # noqa: ARG002
        """The model call's keywords (every hidden state kept for the head)."""
        return dict(
            input_ids=self.input_ids,
            attention_mask=None,
            position_ids=self.positions,
            logits_to_keep=0,
            use_cache=False,
            segment_runs=self.runs,
            segment_blocks=self.blocks,
        )


@dataclass(frozen=True)
class PackedGroups(PaddingFree):
    """`PromptPacking` without padding: the groups laid end to end in one `[1, N]` row,
    each its prompt's real tokens (no left padding) then its responses' real tokens, so
    no projection runs on a padding token (about 16% of the tokens of a GSM8K-shaped
    micro-batch, docs/benchmarks.md). Attention runs per group (`segment_sdpa` with
    `segment_blocks`): a prompt token sees the prompt before it, a response token the
    prompt and its own response before it.

    Attributes:
        input_ids, positions: `[1, N]`.
        runs: each group's length, in order.
        blocks: `[N]` long, 0 on a prompt token, k on the group's k-th response.
        rows, columns: `[B, R]`: where in the `[1, N]` hidden states sits the state
            predicting each response column (a response's first token: its prompt's
            last); 0 where `real` is False.
        real: `[B, R]` bool, the response columns that hold real tokens.
    """

    @staticmethod
    def build(  # type: ignore[override]
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        prompt: int,
        first: torch.Tensor,
        inverse: torch.Tensor,
    ) -> PackedGroups | None:
        """As `PromptPacking.build` (right-padded responses); None when a prompt has no
        real token (nothing would predict its responses' first tokens)."""
        dev = input_ids.device
        real = attention_mask[:, prompt:].bool()  # [B, R]
        kept = attention_mask[first, :prompt].bool()  # [U, P]
        if not bool(kept.any(-1).all()):
            return None
        ids, pos, blocks, runs = [], [], [], []
        columns = torch.zeros(real.shape, dtype=torch.long, device=dev)
        at = 0
        for u in range(first.shape[0]):
            start, head = at, int(first[u])
            ids.append(input_ids[head, :prompt][kept[u]])
            pos.append(positions[head, :prompt][kept[u]])
            at += ids[-1].shape[0]
            last = at - 1  # the prompt's last token predicts each response's first
            blocks.append(torch.zeros_like(ids[-1]))
            for k, row in enumerate((inverse == u).nonzero().squeeze(-1).tolist(), 1):
                n = int(real[row].sum())
                ids.append(input_ids[row, prompt : prompt + n])
                pos.append(positions[row, prompt : prompt + n])
                blocks.append(torch.full_like(ids[-1], k))
                columns[row, :n] = torch.arange(at - 1, at + n - 1, device=dev)  # j by j − 1
                columns[row, :1] = last
                at += n
            runs.append(at - start)
        return PackedGroups(
            torch.cat(ids)[None],
            torch.cat(pos)[None],
            runs,
            torch.zeros_like(columns),
            columns,
            real,
            torch.cat(blocks),
        )


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


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether any module recomputes its forward in backward (gradient checkpointing):
    the recompute would not see a temporarily switched attention."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


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
) -> PackedGroups | PromptPacking | None:
    """The packing of this micro-batch, or None where it is not taken: no shared prompt,
    an attention other than SDPA (a boolean 4-D mask is SDPA's), or too little gain.
    `PackedGroups` (no padding) unless the model checkpoints its layers or a prompt is
    empty; then `PromptPacking` (one padded row per group under a mask)."""
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
    if not checkpointed(model):  # a recompute in backward would not see segment_sdpa
        flat = PackedGroups.build(input_ids, attention_mask, positions, prompt, first, inverse)
        if flat is not None:
            return flat
    return PromptPacking.build(input_ids, attention_mask, positions, prompt, first, inverse)
