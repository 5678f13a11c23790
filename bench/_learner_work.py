"""The workloads and the FLOP count of bench/learner.py: an SFT, a GRPO and a DPO train
step of the learner as the recipes feed it, and the matmul peak of this CPU at the
model's projection shapes.

FLOPs of one train step (forward + backward = 3 forwards, no recomputation):

    6·N_body·T + 6·V·h·T_logits + 12·L·h·P

N_body: the parameters of the decoder layers and the final norm (the embedding lookup
costs no FLOPs; a tied or untied LM head is the second term); T: real (non-padding)
tokens (a prompt shared by a group's rows once); V·h: the LM head; T_logits: the tokens
whose logprobs the loss reads (`response_mask`, where learner/logprobs.py runs the
head); L layers of width h, P: attended (query, key) pairs, Σ n(n+1)/2 over each
segment (a packed conversation, or a row's real tokens) of n tokens (a group's response
also attends to its prompt): QKᵀ and AV cost 2·h FLOPs per pair each, forward. Kaplan
et al. 2020 (arXiv:2001.08361) §2.1 gives the 6·N and attention terms. `6·N·T` (N all parameters,
the issue's figure) is printed beside it. Full fine-tuning only: with LoRA the frozen
base still costs its forward (2·N) and the backward through activations (2·N) per
token, plus 6·N_lora, which this bench does not run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from posttrain.algorithms.batch import TrainBatch


@dataclass(frozen=True)
class Shape:
    """The sizes of a causal LM that the FLOP count reads (from its config.json)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> Shape:
        heads = config["num_attention_heads"]
        return cls(
            config["hidden_size"],
            config["intermediate_size"],
            config["num_hidden_layers"],
            heads,
            config.get("num_key_value_heads", heads),
            config["vocab_size"],
        )

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer kind, the LM head last."""
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        return {
            "q/o": (h, h),
            "k/v": (h, kv),
            "gate/up": (h, self.intermediate),
            "down": (self.intermediate, h),
            "lm_head": (h, self.vocab),
        }


def matmul_rate(shape: Shape, rows: int, dtype: torch.dtype, threads: int, secs: float) -> dict:
    """FLOP/s of `F.linear(x [rows, in], w [out, in])` at each projection of `shape`
    (best of repeats over about `secs` per shape), with `threads` torch threads; and
    'model mix', the FLOP-weighted rate over one layer's projections and the LM head."""
    torch.set_num_threads(threads)
    out, flops_all, time_all = {}, 0.0, 0.0
    layer_counts = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1, "lm_head": 0}
    for name, (k, n) in shape.projections().items():
        x = torch.randn(rows, k, dtype=dtype)
        w = torch.randn(n, k, dtype=dtype)
        torch.nn.functional.linear(x, w)  # warm the kernel choice
        best, deadline = float("inf"), time.perf_counter() + secs
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        flops = 2.0 * rows * k * n
        out[name] = flops / best
        weight = layer_counts[name] * shape.layers or 1
        flops_all += weight * flops
        time_all += weight * best
    out["model mix"] = flops_all / time_all
    return out


def step_flops(batch: TrainBatch, shape: Shape, n_body: int, n_all: int) -> tuple[float, float]:
    """(counted FLOPs, 6·N·T) of one train step on `batch` (module docstring): the work
    the step needs, not what a learner happens to compute (padding, the LM head on
    tokens no loss reads), so a learner doing more shows a lower rate. The LM head is
    counted on the tokens the loss reads (`response_mask`); rows that share a prompt (a
    GRPO group) count it once, as the learner's packed forward computes it
    (learner/packing.py). 6·N·T counts every row's real tokens."""
    from posttrain.learner.packing import shared_prompts

    mask = batch.attention_mask
    tokens = float(mask.sum())
    logits = float((batch.response_mask[:, batch.response_start :] != 0).sum())
    start = batch.response_start
    groups = None if batch.segment_ids is not None else shared_prompts(batch.input_ids, mask, start)
    if groups is not None:
        first, inverse = groups
        p = mask[first, :start].sum(-1).float()  # [U] each distinct prompt's real tokens
        n = mask[:, start:].sum(-1).float()  # [B] each response's real tokens
        computed = float(p.sum() + n.sum())
        pairs = float((p * (p + 1) / 2).sum() + (p[inverse] * n + n * (n + 1) / 2).sum())
    else:
        if batch.segment_ids is not None:
            seg = batch.segment_ids
            lengths = [
                int((seg[r] == k).sum())
                for r in range(seg.shape[0])
                for k in seg[r].unique()
                if k > 0
            ]
        else:
            lengths = [int(n) for n in mask.sum(-1)]
        computed, pairs = tokens, sum(n * (n + 1) / 2 for n in lengths)
    counted = (
        6.0 * n_body * computed
        + 6.0 * shape.vocab * shape.hidden * logits
        + 12.0 * shape.layers * shape.hidden * pairs
    )
    return counted, 6.0 * n_all * tokens


def quickstart_batch(vocab: int, prompts: int, group: int, prompt: int, longest: int) -> TrainBatch:
    """recipes/quickstart_grpo.yaml's step shape: `prompts` prompts of `prompt` random
    tokens, `group` samples each (the group's rows share the prompt ids), responses of
    1..`longest` real tokens (uniform, seed 0), right-padded to `longest`; advantages
    ±1 per row, on-policy, the token-mean denominator."""
    g = torch.Generator().manual_seed(0)
    rows, width = prompts * group, prompt + longest
    ids = torch.randint(4, vocab, (rows, width), generator=g)
    ids[:, :prompt] = ids[::group, :prompt].repeat_interleave(group, dim=0)
    lengths = torch.randint(1, longest + 1, (rows,), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    attn[:, prompt:] = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    ids[attn == 0] = 0
    resp = torch.zeros(rows, width)
    resp[:, prompt:] = attn[:, prompt:].float()
    adv = torch.randn(rows, 1, generator=g).sign() * resp
    return TrainBatch(ids, attn, resp, prompt, advantages=adv, loss_denominator=float(resp.sum()))


def grpo_batch(vocab: int, rows: int, prompt: int, response: int) -> TrainBatch:
    """Rows of `prompt` + `response` random tokens (no padding), advantages ±1 per row,
    on-policy (no old logprobs: the loss detaches its own), the token-mean denominator."""
    g = torch.Generator().manual_seed(0)
    width = prompt + response
    ids = torch.randint(4, vocab, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    resp = torch.zeros(rows, width)
    resp[:, prompt:] = 1.0
    adv = torch.randn(rows, 1, generator=g) * resp
    return TrainBatch(ids, attn, resp, prompt, advantages=adv, loss_denominator=float(resp.sum()))


def dpo_batch(vocab: int, pairs: int, prompt: int, response: int) -> TrainBatch:
    """`pairs` preference pairs (chosen, rejected rows) of random tokens with
    precomputed reference sums (DPO's `precompute`), the pairs' denominator."""
    b = grpo_batch(vocab, 2 * pairs, prompt, response)
    g = torch.Generator().manual_seed(1)
    b.advantages = None
    b.ref_sums = -response * (2.0 + torch.rand(2 * pairs, generator=g))
    b.loss_denominator = float(pairs)
    return b


def sft_batch(model_path: str, conversations: int, ranks: int) -> TrainBatch:
    """`conversations` of recipes/sft_tool_arith.yaml (generator tool_chats), tokenised
    with the model's chat template, packed into rows as the recipe's learner gets them
    (`recipes.algo.sft.chat_batch`, max_length 1024) for `ranks` ranks."""
    from transformers import AutoTokenizer

    from posttrain.recipes.algo.sft import chat_batch
    from posttrain.recipes.data.chats import tokenize_chats
    from posttrain.recipes.data.generators import tool_chats
    from posttrain.recipes.loading import load_recipe

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    sets = [f"data.train.size={conversations}", "data.train.seed=1"]
    r = load_recipe(root / "recipes" / "sft_tool_arith.yaml", sets)
    tok = AutoTokenizer.from_pretrained(model_path)
    chats = tokenize_chats(tok, tool_chats(r.data.train, r.model.system_prompt), 1024)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return chat_batch(chats, pad, 1024, True, ranks)
