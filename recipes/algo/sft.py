"""`algorithm: sft` on the controller: supervised fine-tuning on conversations, no rollout
engine, reward service, reference or weight push; only the learner group.

The conversations (recipes/data/chats.py) are tokenised once with their assistant mask,
shuffled once (`data.shuffle_seed`); the last `sft.eval_examples` of that order are held
out and their loss measured every `eval_every` steps; step k trains on the next
`train.prompts_per_step` conversations of the rest (the step is the position, so a
resume needs no more state). A step's conversations are packed into rows of up to
`sft.max_length` tokens (`algorithms.sft.pack_examples`; `sft.packing: false`: one per
row) and the loss is the mean NLL over the step's assistant tokens.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
from tqdm import tqdm

from ...algorithms.batch import TrainBatch, concat, pad_rows_to_multiple
from ...algorithms.sft import SFTLoss, pack_examples
from ...common.telemetry import Span, idle_fraction
from ...config import Recipe, RecipeError
from ..controller import on_learners
from ..data.chats import TokenizedChat, tokenize_chats
from ..state import Run
from .base import PairAlgorithm


def split_eval(order: list[int], eval_examples: int) -> tuple[list[int], list[int]]:
    """(train, eval) positions: the last `eval_examples` of `order` are held out.

    Raises:
        RecipeError: no training conversation would be left.
    """
    if eval_examples >= len(order):
        raise RecipeError(
            f"sft.eval_examples is {eval_examples}, but the data has only {len(order)} "
            f"conversations; set it below {len(order)}"
        )
    cut = len(order) - eval_examples
    return order[:cut], order[cut:]


def chat_batch(
    chats: list[TokenizedChat], pad_id: int, max_length: int, pack: bool, ranks: int
) -> TrainBatch:
    """The conversations as rows (packed or one per row), padded to a multiple of the
    ranks with rows that count nowhere, and `loss_denominator` = their assistant tokens."""
    rows = pack_examples([(c.ids, c.mask) for c in chats], pad_id, max_length, pack, ranks)
    batch = pad_rows_to_multiple(rows.batch(), ranks)
    batch.loss_denominator = max(float(batch.response_mask.sum()), 1.0)
    return batch


class SFT(PairAlgorithm):
    """`algorithm: sft` (see `algorithms.sft`)."""

    name = "sft"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.loss = SFTLoss()
        self.temperature = 1.0

    def prepare(self, run: Run) -> None:
        """Tokenise every conversation with its assistant mask, shuffle once and split
        off the held-out ones."""
        from transformers import AutoTokenizer

        cfg = self.recipe.sft
        tok = AutoTokenizer.from_pretrained(run.model_path)
        self.chats = tokenize_chats(tok, run.data, cfg.max_length)
        tokens = sum(sum(c.mask) for c in self.chats)
        print(
            f"sft: {len(self.chats)} conversations, {tokens} assistant tokens "
            f"(packing {'on' if cfg.packing else 'off'}, max_length {cfg.max_length})",
            flush=True,
        )
        g = torch.Generator().manual_seed(self.recipe.data.shuffle_seed)
        order = torch.randperm(len(self.chats), generator=g).tolist()
        self.order, self.eval_order = split_eval(order, cfg.eval_examples)

    def checkpoint_state(self) -> dict[str, Any]:
        """The order's seed and split: step k trains on `order[k·n : (k+1)·n]`."""
        return {
            "order_seed": self.recipe.data.shuffle_seed,
            "conversations": len(self.order),
            "eval_examples": len(self.eval_order),
        }

    def step(self, run: Run, step: int) -> tuple[dict[str, float], list[Span]]:
        learners, per_step, cfg = (
            run.roles.learners,
            self.recipe.train.prompts_per_step,
            self.recipe.sft,
        )
        t0 = time.time()
        idx = [self.order[(step * per_step + k) % len(self.order)] for k in range(per_step)]
        chats = [self.chats[i] for i in idx]
        batch = chat_batch(chats, run.roles.pad_id, cfg.max_length, cfg.packing, len(learners))
        stats = on_learners(learners, "train_step", batch, step)[0]
        t_train = time.time()
        evaluated = {}
        last = step + 1 == self.recipe.train.steps
        if self.eval_order and ((step + 1) % cfg.eval_every == 0 or last):
            evaluated = self.evaluate(learners, run.roles.pad_id, step)
        t_end = time.time()
        spans = [s for part in ray.get([lw.drain_spans.remote() for lw in learners]) for s in part]
        tokens = float(sum(len(c.ids) for c in chats))  # not the padding rows' copies
        return {
            **stats,
            **evaluated,
            "time/step": t_end - t0,
            "time/train": t_train - t0,
            "time/eval": t_end - t_train,
            "tokens": tokens,
            "tokens_per_s": tokens / max(t_train - t0, 1e-9),
            "learner_idle_fraction": idle_fraction(spans, "learner", len(learners), t0, t_end),
        }, spans

    def evaluate(self, learners: list[Any], pad_id: int, step: int) -> dict[str, float]:
        """The held-out conversations' loss, no gradient: `eval/loss` (mean NLL per
        assistant token) and `eval/tokens`."""
        cfg = self.recipe.sft
        chunk = len(learners) * max(1, self.recipe.train.micro_batch_size) * 4
        nll = tokens = 0.0
        for i in range(0, len(self.eval_order), chunk):
            chats = [self.chats[j] for j in self.eval_order[i : i + chunk]]
            batch = chat_batch(chats, pad_id, cfg.max_length, cfg.packing, len(learners))
            lp = concat(on_learners(learners, "compute", batch, step, "old_logprobs"))
            nll += float(-(lp * batch.response_mask).sum())
            tokens += float(batch.response_mask.sum())
        loss = nll / max(tokens, 1.0)
        n = len(self.eval_order)
        tqdm.write(f"eval after step {step}: held-out loss {loss:.4f} ({n} conversations)")
        return {"eval/loss": loss, "eval/tokens": tokens}
