"""The simulated long tail of generation times (`debug.rollout_tail_every`)."""

from __future__ import annotations

import pytest

from posttrain.actors.debug import DebugSettings
from posttrain.actors.rollout import PromptRequest


def _delay(requests: list[str], n: int, every: int) -> float:
    debug = DebugSettings(delay_s=0.5, tail=(every, 8.0))
    return debug.generate_delay([PromptRequest(g, []) for g in requests], n)


def test_a_call_holding_a_long_sample_sleeps_the_tail_factor():
    # SHA-256 of the uid, first 4 bytes mod 8: s0-p3-0-{0,1,2,3} → 0, 0, 2, 3 (long);
    # s0-p5-1-{0,1,2,3} → 4, 4, 6, 1 (none long)
    assert _delay(["s0-p5-1"], 4, every=8) == pytest.approx(0.5)
    assert _delay(["s0-p3-0"], 4, every=8) == pytest.approx(4.0)
    assert _delay(["s0-p5-1", "s0-p3-0"], 4, every=8) == pytest.approx(4.0)  # the batch waits
    assert _delay(["s0-p3-0"], 4, every=0) == pytest.approx(0.5)  # off


def test_the_push_fault_drill_refuses_only_its_worker_and_version():
    from posttrain.weightsync import WeightSyncError

    debug = DebugSettings(fail_push=(1, 3))
    debug.check_push(0, 3)
    debug.check_push(1, 2)
    with pytest.raises(WeightSyncError, match="rollout worker 1: debug.fail_weight_push.*3"):
        debug.check_push(1, 3)
