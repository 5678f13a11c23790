"""`run_updates`: each epoch trains on every real row exactly once, split into the
recipe's mini-batches, none of them all padding, each padded to the rank count."""

from __future__ import annotations

import torch

import posttrain.recipes.algo.base as algorithm
from posttrain.algorithms.batch import TrainBatch, pad_rows_to_multiple


def test_mini_batches_cover_the_real_rows_once_per_epoch(monkeypatch):
    rows, ranks, seen = 5, 2, []

    def fake_on_learners(learners, method, sub, step):
        seen.append(sub)
        return [{"loss": float(len(sub)), "grad_norm": 1.0, "lr": 0.1}] * len(learners)

    monkeypatch.setattr(algorithm, "on_learners", fake_on_learners)
    ids = torch.arange(rows)[:, None].repeat(1, 3)  # row i holds token id i
    batch = TrainBatch(ids, torch.ones(rows, 3, dtype=torch.long), torch.ones(rows, 3), 1)
    padded = pad_rows_to_multiple(batch, ranks)  # what the no-grad passes ran on
    stats = algorithm.run_updates(
        [None] * ranks,
        padded,
        rows,
        epochs=2,
        mini_batches=3,
        loss_agg="token_mean",
        seed=0,
        step=0,
    )
    assert len(seen) == 6 and stats["grad_norm"] == 1.0
    for epoch in (seen[:3], seen[3:]):
        real = [
            int(s.input_ids[i, 0])
            for s in epoch
            for i in range(len(s))
            if s.response_mask[i].sum() > 0
        ]
        assert sorted(real) == list(range(rows))  # every real row once
        for s in epoch:
            assert len(s) % ranks == 0 and s.response_mask.sum() > 0  # never all padding
            assert s.loss_denominator == float(s.response_mask.sum())


def test_skipped_updates_are_counted_not_averaged(monkeypatch):
    calls = []

    def fake_on_learners(learners, method, sub, step):
        calls.append(sub)
        skipped = 1.0 if len(calls) in (1, 3) else 0.0
        return [{"loss": 0.0, "grad_norm": 1.0, "lr": 0.1, "skipped_updates": skipped}]

    monkeypatch.setattr(algorithm, "on_learners", fake_on_learners)
    batch = TrainBatch(
        torch.zeros(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3), 1
    )
    stats = algorithm.run_updates([None], batch, 4, 2, 2, "token_mean", 0, 0)
    assert len(calls) == 4 and stats["skipped_updates"] == 2.0
