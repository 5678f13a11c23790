"""The simulated long tail of generation times (`debug.rollout_tail_every`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.actors.rollout import PromptRequest
from posttrain.actors.worker import RolloutWorker


def _delay(requests: list[str], n: int, every: int) -> float:
    me = SimpleNamespace(delay_s=0.5, tail=(every, 8.0))
    return RolloutWorker._delay(me, [PromptRequest(g, []) for g in requests], n)


def test_a_call_holding_a_long_sample_sleeps_the_tail_factor():
    # SHA-256 of the uid, first 4 bytes mod 8: s0-p3-0-{0,1,2,3} → 0, 0, 2, 3 (long);
    # s0-p5-1-{0,1,2,3} → 4, 4, 6, 1 (none long)
    assert _delay(["s0-p5-1"], 4, every=8) == pytest.approx(0.5)
    assert _delay(["s0-p3-0"], 4, every=8) == pytest.approx(4.0)
    assert _delay(["s0-p5-1", "s0-p3-0"], 4, every=8) == pytest.approx(4.0)  # the batch waits
    assert _delay(["s0-p3-0"], 4, every=0) == pytest.approx(0.5)  # off
