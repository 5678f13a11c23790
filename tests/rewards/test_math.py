"""The built-in math verifier on hand-picked answers."""

from __future__ import annotations

import pytest

from posttrain.rewards.math_verifier import score_math


@pytest.mark.parametrize(
    ("response", "gold", "want"),
    [
        ("\\boxed{2}", "2", 1.0),
        ("I don't know.", "2", 0.0),
        ("", "5", 0.0),
        ("\\boxed{137}", "5", 0.0),
        ("\\boxed{5}", "5", 1.0),
        ("\\boxed{\\text{13}}", "13", 1.0),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("The total is 1,234 dollars.", "1234", 1.0),
        ("Half of it: \\frac{1}{2}", "0.5", 1.0),
        ("3 + 4 = 7", "7", 1.0),
        ("3 + 4 = 8", "7", 0.0),
    ],
)
def test_cases(response, gold, want):
    assert score_math(response, gold)[0] == want


def test_reads_the_response_never_the_prompt():
    # the gold answer appears in a prompt we never pass; the response alone decides
    assert score_math("I think it is 12", "13")[0] == 0.0


def test_extracted_answer_in_details():
    assert score_math("\\boxed{137}", "5")[1]["extracted"] == "137"


def test_missing_ground_truth_raises():
    with pytest.raises(ValueError, match="ground_truth"):
        score_math("42", None)
