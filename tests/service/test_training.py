"""`TrainingModel` without HTTP: bfloat16 compute (float32 masters) agrees with float32
to bf16 precision and trains."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from posttrain.service.training import Adam, ModelSpec, TrainingModel
from posttrain.service.wire import WireDatum


def test_bfloat16_compute_matches_float32_and_trains(tiny_model: Path) -> None:
    ids = np.array([4, 5, 6, 7, 8], dtype=np.int64)
    datum = WireDatum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(4, np.float32)})
    fp32 = TrainingModel(ModelSpec("t", tiny_model, 4, seed=0))
    bf16 = TrainingModel(ModelSpec("t", tiny_model, 4, seed=0, dtype="bfloat16"))
    assert fp32.checksum() == bf16.checksum()  # same masters
    (a,), _ = fp32.forward_backward([datum], "cross_entropy", {}, True)
    (b,), _ = bf16.forward_backward([datum], "cross_entropy", {}, False)
    np.testing.assert_allclose(b["logprobs"], a["logprobs"], atol=0.05)  # bf16: 8 bits
    before = bf16.checksum()
    bf16.optim_step(Adam(1e-2, 0.9, 0.95, 1e-8, 0.0, 0.0))
    assert bf16.checksum() != before
    assert all(p.dtype.is_floating_point and p.dtype.itemsize == 4 for p in bf16.params)
