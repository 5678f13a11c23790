"""The learner with a scalar head (`head='score'`, algorithm reward_model) on 2 FSDP2
ranks, full fine-tuning and LoRA: the first step's loss is log 2 from a zero head, the
loss falls, and the saved folder (merged, and for LoRA the PEFT adapter too) loads with
`AutoModelForSequenceClassification` and gives the learner's own scores."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.algorithms.reward_model import RewardModelLoss
from posttrain.learner.adapters import AdapterSettings
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from posttrain.recipes.algo.dpo import pair_batch
from posttrain.recipes.data.pair_tokens import tokenize_pairs_with_template
from posttrain.recipes.data.pairs import PreferencePair
from tests.learner.ranks import run_ranks

PAIRS = [
    PreferencePair(
        i,
        [{"role": "user", "content": f"Item {i}?"}],
        f"Yes {'!' * (i % 3 + 1)}",
        f"No{'.' * (i % 2 + 1)}",
    )
    for i in range(4)
]


def _batch(model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    pairs = tokenize_pairs_with_template(PAIRS, tok, 64).pairs
    batch = pair_batch(pairs, tok.pad_token_id)
    batch.loss_denominator = float(len(pairs))
    return batch, pairs


def _rank_main(rank, world, model_path, adapter, out, port, queue):
    w = LearnerWorker(
        rank,
        world,
        LearnerSettings(
            model_path=str(model_path),
            compute_dtype="float32",
            lr=5e-2,
            micro_batch_size=2,
            algorithm="reward_model",
            loss=RewardModelLoss(),
            head="score",
            adapter=AdapterSettings(type=adapter, r=4, alpha=8, save_merged=True),
        ),
        threads=1,
    )
    w.setup(port)
    with torch.no_grad():  # a zero head: every score 0, so the first loss is exactly log 2
        for name, p in w.policy.named_parameters():
            if name.endswith("score.weight") or "modules_to_save" in name and "score" in name:
                p.zero_()
    batch, _ = _batch(model_path)
    stats = [w.train_step(batch.shard(rank, world), step) for step in range(6)]
    scores = w.compute(batch.shard(rank, world), 6, "scores")
    gathered = [torch.zeros_like(scores) for _ in range(world)]
    torch.distributed.all_gather(gathered, scores)
    w.save_checkpoint(str(out), 6)
    if rank == 0:
        buf = io.BytesIO()
        torch.save((stats, torch.cat(gathered)), buf)
        queue.put(buf.getvalue())
    w.close()


def _own_scores(folder, pairs):
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification"
    with torch.no_grad():
        return torch.tensor(
            [
                model(input_ids=torch.tensor([p.prompt_ids + r])).logits[0, 0]
                for p in pairs
                for r in (p.chosen_ids, p.rejected_ids)
            ]
        ), model


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_scalar_head_trains_and_saves(tiny_model, tmp_path, adapter):
    out = tmp_path / "final"
    stats, learner_scores = run_ranks(_rank_main, 2, tiny_model, adapter, out)
    assert stats[0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert stats[0]["rewards/accuracy"] == 0.0  # ties are not ranked right
    assert stats[-1]["loss"] < stats[0]["loss"] - 0.01  # it learns (a random tiny body)
    folder = out / "merged" if adapter == "lora" else out
    _, pairs = _batch(tiny_model)
    scores, model = _own_scores(folder, pairs)
    assert model.config.pad_token_id == 1 and model.config.num_labels == 1
    torch.testing.assert_close(scores, learner_scores, rtol=0, atol=1e-4)
    if adapter == "lora":
        from peft import PeftModel

        base = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
        peft = PeftModel.from_pretrained(base, out).eval()
        with torch.no_grad():
            via_adapter = torch.tensor(
                [
                    peft(input_ids=torch.tensor([p.prompt_ids + r])).logits[0, 0]
                    for p in pairs
                    for r in (p.chosen_ids, p.rejected_ids)
                ]
            )
        torch.testing.assert_close(via_adapter, learner_scores, rtol=0, atol=1e-4)
