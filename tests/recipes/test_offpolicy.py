"""Off-policy accounting of the asynchronous loop (recipes/monitoring/offpolicy.py), on
hand-built samples."""

from __future__ import annotations

import pytest

from posttrain.actors.rollout import Rollout
from posttrain.recipes.monitoring.offpolicy import SampleCounts, offpolicy_metrics, versions_of


def _r(version: int, n: int, versions: list[int] | None = None) -> Rollout:
    return Rollout(
        "u", "g", [1], [5] * n, [-0.1] * n, "stop", version, "p", "r", policy_versions=versions
    )


def test_metrics_hand_computed():
    rollouts = [
        _r(3, 2),  # step 4: staleness 1, one version
        _r(4, 3),  # staleness 0
        _r(3, 4, [3, 3, 4, 4]),  # partial: staleness 1 (its oldest token), two versions
        _r(2, 1),  # staleness 2
    ]
    counts = SampleCounts(generated=20, trained=12, dropped=3)
    m = offpolicy_metrics(rollouts, step=4, k=2, counts=counts, dropped=3)
    assert m["staleness_mean"] == pytest.approx((1 + 0 + 1 + 2) / 4)
    assert m["staleness_max"] == 2.0
    assert (m["staleness_frac/0"], m["staleness_frac/1"], m["staleness_frac/2"]) == (
        0.25,
        0.5,
        0.25,
    )
    # tokens: 2 at lag 1, 3 at 0, (1, 1, 0, 0), 1 at 2 -> (2 + 0 + 2 + 2) / 10
    assert m["staleness_token_mean"] == pytest.approx(6 / 10)
    assert m["versions_spanned_mean"] == pytest.approx(5 / 4)
    # newest token: 1, 0, 0 (its last token is version 4), 2
    assert m["staleness_newest_mean"] == pytest.approx(3 / 4)
    assert m["staleness_newest_max"] == 2.0
    assert m["versions_spanned_max"] == 2.0
    assert (m["samples_trained"], m["samples_dropped"]) == (4.0, 3.0)
    total = m["samples_trained_total"] + m["samples_dropped_total"] + m["samples_waiting"]
    assert m["samples_generated_total"] == total == 20.0
    assert m["samples_waiting"] == 5.0


def test_empty_response_counts_its_version_and_no_samples_is_refused():
    assert versions_of(_r(7, 0)) == [7]
    with pytest.raises(ValueError, match="step 3: no samples"):
        offpolicy_metrics([], 3, 1, SampleCounts(), 0)
