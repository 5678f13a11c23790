"""A reward model trained on a model whose pad token is its EOS (SmolLM2: pad = eos = 2)
reads each row's closing EOS, and the saved folder gives the learner's scores under plain
transformers (`AutoModelForSequenceClassification`), alone and right-padded by its own
tokenizer: the saved config pads with an id that is never the EOS."""

from __future__ import annotations

import io

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.algorithms.reward_model import RewardModelLoss
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from posttrain.recipes.algo.dpo import pair_batch
from posttrain.recipes.data.pair_tokens import tokenize_pairs_with_template
from tests.learner.ranks import run_ranks
from tests.learner.test_reward_model_learner import PAIRS


def _batch(model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    pairs = tokenize_pairs_with_template(PAIRS, tok, 64).pairs
    batch = pair_batch(pairs, tok.pad_token_id)
    batch.loss_denominator = float(len(pairs))
    rows = [p.prompt_ids + r for p in pairs for r in (p.chosen_ids, p.rejected_ids)]
    return batch, rows


def _rank_main(rank, world, model_path, out, port, queue):
    w = LearnerWorker(
        rank,
        world,
        LearnerSettings(
            model_path=str(model_path),
            compute_dtype="float32",
            lr=5e-2,
            micro_batch_size=4,
            algorithm="reward_model",
            loss=RewardModelLoss(),
            head="score",
        ),
        threads=1,
    )
    w.setup(port)
    batch, _ = _batch(model_path)
    for step in range(2):
        w.train_step(batch, step)
    scores = w.compute(batch, 2, "scores")
    w.save_checkpoint(str(out), 2)
    buf = io.BytesIO()
    torch.save(scores, buf)
    queue.put(buf.getvalue())
    w.close()


def test_saved_reward_model_scores_the_closing_eos(tiny_model_pad_eos, tmp_path):
    out = tmp_path / "final"
    learner_scores = run_ranks(_rank_main, 1, tiny_model_pad_eos, out)
    _, rows = _batch(tiny_model_pad_eos)
    eos = AutoTokenizer.from_pretrained(tiny_model_pad_eos).eos_token_id
    assert all(r[-1] == eos for r in rows)  # every row ends with its end of turn
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.pad_token_id not in (None, eos)
    assert tok.pad_token_id == model.config.pad_token_id
    with torch.no_grad():
        # by hand: the score head on the last hidden state, the closing EOS's
        hand = torch.stack(
            [
                model.score(model.model(input_ids=torch.tensor([r])).last_hidden_state[0, -1])[0]
                for r in rows
            ]
        )
        alone = torch.stack([model(input_ids=torch.tensor([r])).logits[0, 0] for r in rows])
        padded = tok.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        assert tok.padding_side == "right" and padded["attention_mask"].min() == 0
        batched = model(**padded).logits[:, 0]
    torch.testing.assert_close(learner_scores, hand, rtol=0, atol=1e-4)
    torch.testing.assert_close(alone, hand, rtol=0, atol=1e-5)
    torch.testing.assert_close(batched, hand, rtol=0, atol=1e-4)
