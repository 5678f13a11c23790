"""Reward-model training as a pure tensor function: the Bradley-Terry pairwise loss on
scalar scores (Ouyang et al. 2022, InstructGPT, eq. 1), with the optional margin of
Llama 2 (Touvron et al. 2023, eq. 2). `bradley_terry` takes one score per reply, `[P]`
for P preference pairs; `loss` is the learner's entry point on a micro-batch of rows,
where row 2i is pair i's chosen reply and row 2i+1 its rejected one (as for DPO).

The learner's model for this algorithm is the policy architecture with a scalar head
(`MODEL_OUTPUT = "scores"`): one score per row, read at the row's last token that is
not the pad id (transformers' sequence-classification pooling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .batch import TrainBatch
from .common import LossOutput, ratio_of

#: Rows of one example: a pair is its chosen row then its rejected row.
ROWS_PER_EXAMPLE = 2
#: The learner's forward for this loss: `[b]` scalar scores, not `[b, T]` logprobs.
MODEL_OUTPUT = "scores"


@dataclass
class PairTerms:
    """Per-pair results, each `[P]`.

    Attributes:
        loss: −log σ(r_chosen − r_rejected − m) of each pair.
        correct: 1.0 where r_chosen > r_rejected (ties count as wrong), else 0.0.
        chosen, rejected: the scores, detached.
    """

    loss: torch.Tensor
    correct: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor


def bradley_terry(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0
) -> PairTerms:
    """Bradley-Terry loss per pair: loss = −log σ(r_c − r_r − m).

    InstructGPT (Ouyang et al. 2022, eq. 1) is m = 0; Llama 2 (Touvron et al. 2023,
    eq. 2) subtracts a margin m(r) ≥ 0 that grows with how clearly the annotator
    preferred the chosen reply, so the model must separate such pairs further.
    Pairwise accuracy ignores the margin: a pair is ranked right when r_c > r_r.

    Args:
        chosen, rejected: `[P]` scalar scores of each pair's two replies.
        margin: a float, or `[P]` one per pair.

    Raises:
        ValueError: `chosen`, `rejected` (and a tensor `margin`) differ in shape.
    """
    shapes = {tuple(chosen.shape), tuple(rejected.shape)}
    if isinstance(margin, torch.Tensor):
        shapes.add(tuple(margin.shape))
    if len(shapes) != 1:
        raise ValueError(f"chosen, rejected and margin must have one shape [P], got {shapes}")
    diff = chosen - rejected
    return PairTerms(
        loss=-F.logsigmoid(diff - margin),
        correct=(diff > 0).to(chosen.dtype),
        chosen=chosen.detach(),
        rejected=rejected.detach(),
    )


@dataclass(frozen=True)
class RewardModelLoss:
    """Plain settings of the reward-model loss (from the recipe's `reward_model:` block).

    Attributes:
        margin: a margin every pair gets, added to each pair's own (`TrainBatch.margins`).
    """

    margin: float = 0.0


def loss(
    scores: torch.Tensor, mb: TrainBatch, cfg: RewardModelLoss, values: torch.Tensor | None = None
) -> LossOutput:
    """The Bradley-Terry loss of one micro-batch of whole pairs.

    Args:
        scores: `[2p]` scores with gradients, chosen/rejected interleaved.
        mb: `response_mask [2p, T]` (padding pairs are all zero and count nowhere),
            `margins [2p]` (each pair's margin on both its rows; None: 0) and
            `loss_denominator` (real pairs in the step).
        cfg: the constant margin.
        values: unused.

    Raises:
        ValueError: the rows are not whole pairs.
    """
    if len(mb) % 2 or scores.shape != (len(mb),):
        raise ValueError(
            f"the reward-model loss needs [2p] scores of whole (chosen, "
            f"rejected) pairs; got scores {tuple(scores.shape)} for {len(mb)} rows"
        )
    margin = cfg.margin + (mb.margins[0::2].to(scores.dtype) if mb.margins is not None else 0.0)
    t = bradley_terry(scores[0::2], scores[1::2], margin)
    valid = (mb.response_mask[0::2].sum(-1) > 0).to(scores.dtype)
    total = (t.loss * valid).sum() / mb.loss_denominator
    return LossOutput(
        total,
        {
            "loss": float(total.detach()),
            "won": float((t.correct * valid).sum()),
            "chosen": float((t.chosen * valid).sum()),
            "rejected": float((t.rejected * valid).sum()),
            "pairs": float(valid.sum()),
        },
    )


def finish_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Step metrics: loss, pairwise accuracy, mean chosen / rejected score and their
    difference (the reward margin), per real pair."""
    chosen, rejected = ratio_of(sums, "chosen", "pairs"), ratio_of(sums, "rejected", "pairs")
    return {
        "loss": sums.get("loss", 0.0),
        "rewards/accuracy": ratio_of(sums, "won", "pairs"),
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margin": chosen - rejected,
    }
