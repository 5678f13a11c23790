"""Where a scalar-head (reward) model is read: the last token the attention mask marks,
never the last token that is not the pad id, which misses a row's closing EOS when pad
= eos (SmolLM2: pad = eos = 2). Training (the learner) and serving (the reward service)
read it through one function, `common.score_head.sequence_scores`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.algorithms.batch import TrainBatch
from posttrain.config.rewards import RewardModelReward
from posttrain.learner.models import reward_scores
from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.reward_model import RewardModelScorer

# the hand case: pad = eos = 2, the head's output at position i is i / 10
RIGHT = ([1, 5, 2, 7, 8, 2, 2, 2], [1, 1, 1, 1, 1, 1, 0, 0])  # → index 5 (0.5)
LEFT = ([2, 2, 1, 5, 2, 7, 8, 2], [0, 0, 1, 1, 1, 1, 1, 1])  # → index 7 (0.7)


class PositionHead(torch.nn.Module):
    """A score head whose output at position i is i / 10 (`[B, T, 1]`)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden.shape
        pos = torch.arange(t, dtype=hidden.dtype, device=hidden.device) / 10
        return pos.expand(b, t).unsqueeze(-1) + 0 * hidden[..., :1]


@pytest.fixture(scope="module")
def pad_eos_model(tiny_model_pad_eos):
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_pad_eos, num_labels=1, pad_token_id=2
    ).eval()
    model.score = PositionHead()
    return model


def _tensors() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([RIGHT[0], LEFT[0]])
    return ids, torch.tensor([RIGHT[1], LEFT[1]])


def test_hand_case_index_and_scores(pad_eos_model):
    from posttrain.common.score_head import last_token_index, sequence_scores

    ids, mask = _tensors()
    assert last_token_index(mask).tolist() == [5, 7]
    with torch.no_grad():
        got = sequence_scores(pad_eos_model, ids, mask)
        # transformers' own pooling (last token that is not pad id 2) reads 4 and 6
        theirs = pad_eos_model(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert got.tolist() == pytest.approx([0.5, 0.7], abs=1e-6)
    assert theirs.tolist() == pytest.approx([0.4, 0.6], abs=1e-6)


def test_learner_reads_the_same_index(pad_eos_model):
    ids, mask = _tensors()
    mb = TrainBatch(ids, mask, mask.float(), 1)
    with torch.no_grad():
        assert reward_scores(pad_eos_model, mb).tolist() == pytest.approx([0.5, 0.7], abs=1e-6)


def test_service_reads_the_closing_eos(tiny_model_pad_eos, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_pad_eos, num_labels=1)
    model.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_model_pad_eos).save_pretrained(tmp_path / "rm")
    scorer = RewardModelScorer(
        RewardModelReward(name="rm", type="reward_model", path=str(tmp_path / "rm"))
    )
    scorer.model.score = PositionHead()
    items = [
        ScoreItem(uid="a", prompt="What is 2+2?", response="4"),
        ScoreItem(uid="b", prompt="Q", response="A longer answer"),
    ]
    rows = [scorer.token_ids(i) for i in items]
    assert all(r[-1] == scorer.tokenizer.eos_token_id for r in rows)
    width = max(len(r) for r in rows)
    # left-padded to `width`: every row ends at the last column, its closing EOS
    assert scorer.raw_scores(items) == pytest.approx([(width - 1) / 10] * 2, abs=1e-6)


def test_pooling_pad_id_never_the_eos(tiny_model, tiny_model_pad_eos):
    from posttrain.common.score_head import pooling_pad_id

    tok = AutoTokenizer.from_pretrained(tiny_model_pad_eos)
    assert tok.pad_token_id == tok.eos_token_id == 3
    pad = pooling_pad_id(tok, 3)
    # a special token that is not the EOS nor the BOS: <unk> (0) of the tiny vocabulary
    assert pad == 0 and pad != tok.eos_token_id
    # a pad distinct from the EOS is kept
    assert pooling_pad_id(AutoTokenizer.from_pretrained(tiny_model), 1) == 1
