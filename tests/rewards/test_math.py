"""The built-in math verifier on hand-picked answers."""

from __future__ import annotations

import pytest

from posttrain.rewards.math_answer import is_computation
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


# Golds as MATH writes them (bare LaTeX) are parsed whole, never cut to a number.
@pytest.mark.parametrize(
    ("response", "gold", "want"),
    [
        ("The answer is \\boxed{2}.", "2\\sqrt{2}", 0.0),
        ("The answer is \\boxed{2\\sqrt{2}}.", "2\\sqrt{2}", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{\\sqrt{3}}{2}", 0.0),
        ("\\boxed{3\\pi/2}", "\\frac{3\\pi}{2}", 1.0),
        ("\\boxed{3}", "3\\pi", 0.0),
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
        ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1.0),
        ("\\boxed{2x+3}", "y = 2x + 3", 1.0),
        # plain numbers and GSM8K solutions keep working as golds
        ("\\boxed{1234}", "1234", 1.0),
        ("The total is 1,234.", "1234", 1.0),
        ("\\boxed{-7}", "-7", 1.0),
        ("\\boxed{7}", "-7", 0.0),
        ("The answer is 3/4.", "3/4", 1.0),
        ("\\boxed{0.75}", "3/4", 1.0),
        ("#### 0.5", "0.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("#### 72", "She sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0),
        ("#### 24", "She sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 0.0),
        ("\\boxed{5}", "$5$", 1.0),
        ("\\boxed{5}", "\\boxed{5}", 1.0),
    ],
)
def test_latex_and_plain_golds(response, gold, want):
    assert score_math(response, gold)[0] == want


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("Therefore the answer is +7", "+7"),
        ("Therefore the answer is +7", "7"),
        ("Therefore the answer is 7", "+7"),
        ("So x = +7", "7"),
        ("\\boxed{+7}", "7"),
        ("#### +7", "7"),
        ("Answer: +7.", "7"),
    ],
)
def test_explicit_plus_sign_keeps_the_answer(response, gold):
    assert score_math(response, gold)[0] == 1.0


def test_plus_between_numbers_is_still_addition():
    assert score_math("3 + 4 = 7", "7")[0] == 1.0
    assert score_math("The answer is 3 + 4", "7")[0] == 1.0


# The last explicit marker counts; whatever the model says after it does not.
@pytest.mark.parametrize(
    ("response", "gold", "want"),
    [
        ("2+40=42\n#### 42\nThis matches step 3 of the plan.", "42", 1.0),
        ("2+40=42\n#### 42\nThis matches step 3 of the plan.", "3", 0.0),
        ("#### 42\nThe answer is consistent with step 3.", "42", 1.0),
        ("So \\boxed{5}. Checking: 2 + 3 = 5, and 7 - 2 = 5 too; 11 items.", "5", 1.0),
        ("\\boxed{5}. I am sure the answer is correct, see step 9.", "5", 1.0),
        ("The answer is 12. Check: 3 * 4 = 12, as in problem 7.", "12", 1.0),
        ("The answer is 5 because 2 + 2 = 4", "5", 1.0),
        ("**Answer:** 1,234 dollars, not 99.", "1234", 1.0),
        ("\\boxed{3}. Wait, that is wrong: \\boxed{4}", "4", 1.0),
        ("\\boxed{3}. Wait, that is wrong: \\boxed{4}", "3", 0.0),
        ("The answer is 4.\n#### 5", "5", 1.0),
        ("The final answer is $\\boxed{5}$. I hope it is correct.", "5", 1.0),
    ],
)
def test_last_explicit_marker_counts(response, gold, want):
    assert score_math(response, gold)[0] == want


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("The answer is 1234 or maybe 12.", "1234"),
        ("The answer is 1234 or maybe 12.", "12"),
        ("The answer is either 3 or 4.", "3"),
        ("The answer is either 3 or 4.", "4"),
        ("\\boxed{3 \\text{ or } 4}", "4"),
        ("#### 7 or 8", "7"),
        ("The answer is $x = 2$ or $x = -3$.", "2"),
    ],
)
def test_hedged_answers_score_zero(response, gold):
    score, details = score_math(response, gold)
    assert (score, details["hedged"]) == (0.0, True)


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("The answer is 1/2, or equivalently 0.5.", "0.5"),
        ("The answer is x = 2 or x = -3.", "2, -3"),  # the gold is a set: "or" lists it
        ("The answer is $x = 2$ or $x = -3$.", "-3, 2"),
    ],
)
def test_alternatives_that_agree_or_list_a_set_are_not_hedges(response, gold):
    assert score_math(response, gold)[0] == 1.0


def test_details_say_where_the_answer_came_from():
    assert score_math("#### 42\nstep 3", "42")[1] == {
        "extracted": "42",
        "source": "####",
        "hedged": False,
    }
    assert score_math("so 3 + 4 = 7", "7")[1]["source"] == "last value"
    assert score_math("no idea", "7")[1] == {"extracted": None, "source": None, "hedged": False}


def test_gold_without_a_value_raises():
    with pytest.raises(ValueError, match="no answer math-verify can parse"):
        score_math("\\boxed{5}", "x =")


# A `$` that nothing closes on its line is a currency sign, and the sentence's full stop
# and Markdown emphasis are not part of the answer (field reports: these scored 0).
@pytest.mark.parametrize(
    ("response", "gold", "want"),
    [
        ("The answer is $1,234.", "1234", 1.0),
        ("The answer is $7.", "7", 1.0),
        ("The answer is $7.", "8", 0.0),
        ("answer: $1,234.", "1234", 1.0),
        ("**Answer:** $1,234.", "1234", 1.0),
        ("The answer is **$1,234**.", "1234", 1.0),
        ("**$1,234**.", "1234", 1.0),
        ("Answer: **1,234**.", "1234", 1.0),
        ("The answer is *7*.", "7", 1.0),
        ("#### $1,234.", "1234", 1.0),
        ("#### **42**", "42", 1.0),
        ("The answer is $1,234,567.", "1234567", 1.0),
        ("The answer is $12.50.", "12.5", 1.0),
        ("The answer is $-7.", "-7", 1.0),
        ("The answer is \\$1,234.", "1234", 1.0),
        ("The answer is $1,234$.", "1234", 1.0),  # closed: LaTeX, as before
        ("The answer is $x = 2$.", "2", 1.0),
        ("\\boxed{z^*}", "z^*", 1.0),  # a trailing star after ^ is not emphasis
        ("\\boxed{1,234.}", "1234", 1.0),
        ("\\boxed{7.}", "7", 1.0),
    ],
)
def test_currency_and_trailing_punctuation(response, gold, want):
    assert score_math(response, gold)[0] == want


def test_two_amounts_are_a_hedge_not_latex():
    # Pandoc's rule: the `$` before 6 follows a space and precedes a digit, so it closes nothing
    assert score_math("The answer is $5 or $6.", "5")[1]["hedged"] is True


# An equation compares as an equation; the gold's form decides (module docstring).
@pytest.mark.parametrize(
    ("response", "gold", "want"),
    [
        ("\\boxed{3x-y+13=0}", "3x+4y+14=0", 0.0),  # same right-hand side, another line
        ("\\boxed{3x+4y+14=0}", "3x+4y+14=0", 1.0),
        ("\\boxed{4y+3x=-14}", "3x+4y+14=0", 1.0),  # terms moved across
        ("\\boxed{6x+8y+28=0}", "3x+4y+14=0", 1.0),  # both sides times 2
        ("\\boxed{0}", "3x+4y+14=0", 0.0),
        ("\\boxed{3x-y+13=0}", "$3x+4y+14=0$", 0.0),
        ("\\boxed{x+y=2}", "y+x=2", 1.0),
        ("\\boxed{x-y=2}", "x+y=2", 0.0),
        ("\\boxed{x=2}", "2x=4", 1.0),  # the gold equation halved
        ("\\boxed{2x=4}", "x=2", 0.0),  # the gold names x's value; 2x = 4 is unsolved
        ("\\boxed{x^2=4}", "x=2", 0.0),
        ("\\boxed{x=2}", "x^2=4", 0.0),
        ("\\boxed{2x-y+3=0}", "y=2x+3", 1.0),
        ("\\boxed{y=2x+4}", "y=2x+3", 0.0),
        ("\\boxed{2x+3}", "y=2x+3", 1.0),  # a value answers y = ... by its right side
        ("\\boxed{2x+4}", "y=2x+3", 0.0),
        # value golds: the answer's last right-hand side, as before
        ("\\boxed{x=5}", "5", 1.0),
        ("\\boxed{y=5}", "x=5", 1.0),
        ("\\boxed{2+3=5}", "5", 1.0),
        ("\\boxed{\\pi r^2=12\\pi}", "12\\pi", 1.0),
    ],
)
def test_equations_compare_as_equations(response, gold, want):
    assert score_math(response, gold)[0] == want


# A `####` line that carries no value (a Markdown heading) never outranks an answer.
@pytest.mark.parametrize(
    "after",
    [
        "#### Check",
        "#### All 3 steps verified.",
        "#### Step 3 verified",
        "#### Done, see step 2",
        "#### **Verification**",
        "#### (verified)",
        "#### ---",
        "#### ...",
        "####",
    ],
)
def test_hash_line_without_a_value_is_not_a_marker(after):
    score, details = score_math(f"The answer is \\boxed{{42}}.\n{after}", "42")
    assert (score, details["source"]) == (1.0, "boxed")


def test_prose_after_an_answer_phrase_is_not_a_marker():
    assert score_math("\\boxed{42}\nThe answer is (see above).", "42")[0] == 1.0


def test_hash_line_with_a_value_still_counts():
    assert score_math("The answer is \\boxed{2}.\n#### 3", "3")[1]["source"] == "####"


@pytest.mark.parametrize(
    ("response", "want", "extracted"),
    [
        # the field fault: the quickstart's stop string "." cuts the reply here, and the
        # restated question used to score as its own answer (6 + 6 = 12)
        ("To calculate 6 + 6", 0.0, None),
        ("To calculate 6 + 6, add six", 0.0, None),
        ("$6+6$", 0.0, None),
        ("$6 \\times 2$", 0.0, None),
        ("-7+19", 0.0, None),
        # the reply's own answer still counts, wherever the restatement sits
        ("12, since 6 + 6", 1.0, "12"),
        ("To calculate 6 + 6, we add them: 12", 1.0, "12"),
        ("6 + 6 = 12", 1.0, "12"),
        ("$6 \\times 2 = 12$", 1.0, "6 \\times 2 = 12"),
        ("To calculate 6 + 6, you get 13", 0.0, "13"),
    ],
)
def test_a_restated_computation_is_not_the_answer(response, want, extracted):
    score, details = score_math(response, "12")
    assert (score, details["extracted"]) == (want, extracted)


@pytest.mark.parametrize("response", ["\\boxed{6 + 6}", "The answer is 6 + 6."])
def test_an_explicit_marker_commits_to_its_computation(response):
    assert score_math(response, "12")[0] == 1.0


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("6 + 6", True),
        ("(3 - 1) × 4", True),
        ("6 \\div 2", True),
        ("-7", False),
        ("3/4", False),
        ("x + 1", False),
        ("6 + 6 = 12", False),
        ("1,234", False),
    ],
)
def test_is_computation(value, want):
    assert is_computation(value) is want
