"""`algorithm: reward_model` on the controller: a Bradley-Terry reward model trained on
preference pairs (the DPO data formats), no rollout engine, reward service, reference or
weight push; only the learner group, whose policy is the model's architecture with a
scalar head (`LearnerSettings.head = 'score'`).

Pairs are rendered with the model's chat template by default (`reward_model.chat_template`),
as the reward service's `type: reward_model` component renders what it scores: an hh
dialogue becomes its user/assistant turns, a text prompt one user message. The pairs are
shuffled once (`data.shuffle_seed`); the last `reward_model.eval_pairs` of that order (or
the pairs of `data.heldout`, a file of their own) are held out and scored every
`eval_every` steps; step k trains on the next
`train.prompts_per_step` pairs of the rest. The final model goes to RUN_DIR/final as an
`AutoModelForSequenceClassification` folder.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
from tqdm import tqdm

from ...algorithms.batch import concat
from ...algorithms.reward_model import RewardModelLoss, bradley_terry
from ...common.telemetry import Span, idle_fraction
from ...config import Recipe, RecipeError
from ..controller import on_learners
from ..data import load_heldout_pairs
from ..data.pair_tokens import TokenizedPair, render_pairs
from ..data.pairs import as_chat  # noqa: F401  (re-exported)
from ..state import Run
from .base import PairAlgorithm
from .dpo import pair_batch


def split_eval(order: list[int], eval_pairs: int) -> tuple[list[int], list[int]]:
    """(train, eval) positions: the last `eval_pairs` of `order` are held out.

    Raises:
        RecipeError: fewer than one training pair would be left.
    """
    if eval_pairs >= len(order):
        raise RecipeError(
            f"reward_model.eval_pairs is {eval_pairs}, but the data has only "
            f"{len(order)} pairs; set it below {len(order)}"
        )
    cut = len(order) - eval_pairs
    return order[:cut], order[cut:]


class RewardModel(PairAlgorithm):
    """`algorithm: reward_model` (see `algorithms.reward_model`)."""

    name = "reward_model"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.loss = RewardModelLoss(margin=recipe.reward_model.margin)
        self.temperature = 1.0

    def prepare(self, run: Run) -> None:
        """Render and tokenise the pairs, shuffle them once and split off the eval pairs."""
        from transformers import AutoTokenizer

        cfg = self.recipe.reward_model
        tok = AutoTokenizer.from_pretrained(run.model_path)
        pairs = run.data + load_heldout_pairs(self.recipe)
        done = render_pairs(pairs, tok, cfg.max_length, cfg.chat_template)
        print(done.description.replace("DPO prompts", "reward-model pairs"), flush=True)
        self.pairs: list[TokenizedPair] = done.pairs
        self.margins = [pairs[i].margin for i in done.kept]
        g = torch.Generator().manual_seed(self.recipe.data.shuffle_seed)
        if len(pairs) > len(run.data):  # data.heldout: the pairs after data.train's
            n_train = sum(i < len(run.data) for i in done.kept)
            self.order = torch.randperm(n_train, generator=g).tolist()
            self.eval_order = list(range(n_train, len(self.pairs)))
            return
        order = torch.randperm(len(self.pairs), generator=g).tolist()
        self.order, self.eval_order = split_eval(order, cfg.eval_pairs)

    def checkpoint_state(self) -> dict[str, Any]:
        """The pair order's seed and split: step k trains on `order[k·n : (k+1)·n]`."""
        return {
            "order_seed": self.recipe.data.shuffle_seed,
            "pairs": len(self.order),
            "eval_pairs": len(self.eval_order),
        }

    def _batch(self, idx: list[int], multiple: int, pad_id: int) -> Any:
        pairs: list[TokenizedPair | None] = [self.pairs[i] for i in idx]
        batch = pair_batch(pairs + [None] * ((-len(pairs)) % multiple), pad_id)
        margins = [self.margins[i] for i in idx for _ in (0, 1)]
        batch.margins = torch.tensor(margins + [0.0] * (len(batch) - len(margins)))
        return batch

    def step(self, run: Run, step: int) -> tuple[dict[str, float], list[Span]]:
        learners, per_step = run.roles.learners, self.recipe.train.prompts_per_step
        t0 = time.time()
        idx = [self.order[(step * per_step + k) % len(self.order)] for k in range(per_step)]
        batch = self._batch(idx, len(learners), run.roles.pad_id)
        batch.loss_denominator = float(per_step)
        stats = on_learners(learners, "train_step", batch, step)[0]
        t_train = time.time()
        cfg, evaluated = self.recipe.reward_model, {}
        last = step + 1 == self.recipe.train.steps
        if self.eval_order and ((step + 1) % cfg.eval_every == 0 or last):
            evaluated = self.evaluate(learners, run.roles.pad_id, step)
        t_end = time.time()
        spans = [s for part in ray.get([lw.drain_spans.remote() for lw in learners]) for s in part]
        return {
            **stats,
            **evaluated,
            "time/step": t_end - t0,
            "time/train": t_train - t0,
            "time/eval": t_end - t_train,
            "tokens": float(batch.attention_mask.sum()),
            "learner_idle_fraction": idle_fraction(spans, "learner", len(learners), t0, t_end),
        }, spans

    def evaluate(self, learners: list[Any], pad_id: int, step: int) -> dict[str, float]:
        """Scores of the held-out pairs (no gradient): `eval/loss` (mean Bradley-Terry
        loss with the margins), `eval/accuracy`, `eval/chosen`, `eval/rejected`,
        `eval/margin` (mean chosen − rejected score)."""
        chunk = len(learners) * max(2, self.recipe.train.micro_batch_size) * 2
        chosen, rejected, margins = [], [], []
        for i in range(0, len(self.eval_order), chunk // 2):
            idx = self.eval_order[i : i + chunk // 2]
            batch = self._batch(idx, len(learners), pad_id)
            scores = concat(on_learners(learners, "compute", batch, step, "scores"))
            chosen.append(scores[0 : 2 * len(idx) : 2])
            rejected.append(scores[1 : 2 * len(idx) : 2])
            margins.append(batch.margins[0 : 2 * len(idx) : 2])
        c, r = torch.cat(chosen), torch.cat(rejected)
        t = bradley_terry(c, r, self.loss.margin + torch.cat(margins))
        tqdm.write(
            f"eval after step {step}: pairwise accuracy {float(t.correct.mean()):.3f}, "
            f"loss {float(t.loss.mean()):.4f} ({len(c)} held-out pairs)"
        )
        return {
            "eval/loss": float(t.loss.mean()),
            "eval/accuracy": float(t.correct.mean()),
            "eval/chosen": float(c.mean()),
            "eval/rejected": float(r.mean()),
            "eval/margin": float((c - r).mean()),
            "eval/pairs": float(len(c)),
        }
