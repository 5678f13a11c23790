"""On-policy distillation's per-token advantages against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.distill import discounted_sums, distill_advantages

# Two rows of four columns; row 0 has three response tokens, row 1 two (then padding).
TEACHER = torch.tensor([[0.0, -1.0, -0.5, -2.0], [0.0, -0.25, -3.0, 0.0]])
STUDENT = torch.tensor([[0.0, -0.5, -1.5, -1.0], [0.0, -1.25, -1.0, 0.0]])
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
TOL = {"rtol": 0.0, "atol": 1e-6}


def test_per_token_advantage_is_teacher_minus_student():
    # row 0: -1 - (-0.5) = -0.5, -0.5 - (-1.5) = 1.0, -2 - (-1) = -1.0
    # row 1: -0.25 - (-1.25) = 1.0, -3 - (-1) = -2.0; prompt and padding 0
    want = torch.tensor([[0.0, -0.5, 1.0, -1.0], [0.0, 1.0, -2.0, 0.0]])
    torch.testing.assert_close(distill_advantages(TEACHER, STUDENT, MASK), want, **TOL)


def test_kl_weight_discount_and_clip():
    # clip 1.5: row 1's -2.0 becomes -1.5; γ = 0.5, backwards from the last column:
    # row 0: t3 = -1.0; t2 = 1.0 + 0.5·(-1.0) = 0.5; t1 = -0.5 + 0.5·0.5 = -0.25
    # row 1: t3 = 0; t2 = -1.5; t1 = 1.0 + 0.5·(-1.5) = 0.25; then × kl_weight 2
    got = distill_advantages(TEACHER, STUDENT, MASK, kl_weight=2.0, discount=0.5, clip=1.5)
    want = torch.tensor([[0.0, -0.5, 1.0, -2.0], [0.0, 0.5, -3.0, 0.0]])
    torch.testing.assert_close(got, want, **TOL)


def test_full_discount_is_the_rest_of_the_sequence():
    # γ = 1: row 0 sums -0.5 + 1 - 1 = -0.5, 1 - 1 = 0, -1
    got = distill_advantages(TEACHER, STUDENT, MASK, discount=1.0)
    want = torch.tensor([[0.0, -0.5, 0.0, -1.0], [0.0, -1.0, -2.0, 0.0]])
    torch.testing.assert_close(got, want, **TOL)


def test_task_reward_mix_is_added_on_every_response_token():
    task = torch.tensor([0.8, -0.8])
    got = distill_advantages(TEACHER, STUDENT, MASK, task_advantages=task, reward_weight=0.5)
    want = torch.tensor([[0.0, -0.1, 1.4, -0.6], [0.0, 0.6, -2.4, 0.0]])
    torch.testing.assert_close(got, want, **TOL)
    # weight 0: the rewards are measured, never trained on
    plain = distill_advantages(TEACHER, STUDENT, MASK, task_advantages=task, reward_weight=0.0)
    torch.testing.assert_close(plain, distill_advantages(TEACHER, STUDENT, MASK), **TOL)


def test_discounted_sums_by_hand():
    x = torch.tensor([[1.0, 2.0, 4.0]])
    # t2 = 4; t1 = 2 + 0.5·4 = 4; t0 = 1 + 0.5·4 = 3
    torch.testing.assert_close(discounted_sums(x, 0.5), torch.tensor([[3.0, 4.0, 4.0]]), **TOL)


def test_non_finite_logprob_on_the_mask_is_an_error_naming_the_row():
    teacher = TEACHER.clone()
    teacher[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        distill_advantages(teacher, STUDENT, MASK)
    teacher[1, 2], teacher[1, 3] = -3.0, float("-inf")  # padding: ignored
    assert float(distill_advantages(teacher, STUDENT, MASK)[1, 3]) == 0.0


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="differ"):
        distill_advantages(TEACHER, STUDENT[:, :3], MASK)
