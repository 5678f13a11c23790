"""On-policy distillation's advantages, as a pure tensor function.

The student samples a response y ~ π_θ; the teacher π_T scores every sampled token.
The per-token reverse KL estimate is log π_θ(y_t | y_<t) − log π_T(y_t | y_<t), and the
student's per-token advantage is its negative, the teacher − student log-ratio

    r_t = clip(log π_T(y_t) − log π_θ(y_t), −c, c),
    A_t = kl_weight · Σ_{k≥t} γ^(k−t) r_k + reward_weight · A_task,

trained with the policy-gradient loss −A_t · log π_θ(y_t) (GRPO's `ppo_clip` surrogate,
whose ratio is 1 with one update per step). Minimising the sampled reverse KL this way
is GKD with student-generated data (Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes", λ = 1, reverse KL); γ = 0 is
the per-token form of Thinking Machines' "On-policy distillation" (2025), γ = 1 the
full sequence-level score-function gradient. `A_task` is the sample's group-normalised
task reward (`algorithms.grpo.group_advantages`), broadcast over its tokens.

The student logprobs are the ones the rollout engine reported when it sampled
(`inference_logprobs`), so the advantage is measured against the policy that made the
sample, as the importance-sampling loss assumes.
"""

from __future__ import annotations

import torch


def distill_advantages(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_weight: float = 1.0,
    discount: float = 0.0,
    clip: float | None = None,
    task_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> torch.Tensor:
    """Per-token advantages of on-policy distillation (formula in the module docstring).

    Args:
        teacher_logprobs: `[B, T]` the teacher's logprobs of the sampled tokens.
        student_logprobs: `[B, T]` the student's (sampling policy's) logprobs of them.
        response_mask: `[B, T]` 1 on tokens the loss counts; elsewhere the log-ratio is
            taken as 0 (prompt, padding, a multi-turn episode's environment tokens:
            they add nothing but still count as steps for the discount).
        kl_weight: weight of the distillation term (> 0).
        discount: γ in [0, 1]; 0: each token's own log-ratio only.
        clip: clip each token's log-ratio to [−clip, clip] before the discount; None:
            none.
        task_advantages: `[B]` the samples' reward advantages, or None.
        reward_weight: their weight (≥ 0).

    Returns:
        `[B, T]` float32 advantages, 0 off the mask.

    Raises:
        ValueError: shapes differ, or a logprob on the mask is not finite (an engine or
            teacher that returned NaN would otherwise train on it silently).
    """
    if not teacher_logprobs.shape == student_logprobs.shape == response_mask.shape:
        raise ValueError(
            f"teacher {tuple(teacher_logprobs.shape)}, student "
            f"{tuple(student_logprobs.shape)} and mask {tuple(response_mask.shape)} differ"
        )
    m = response_mask.float()
    diff = teacher_logprobs.float() - student_logprobs.float()
    bad = ~torch.isfinite(diff) & (m > 0)
    if bool(bad.any()):
        rows = sorted({int(i) for i in bad.nonzero()[:, 0]})
        raise ValueError(f"non-finite teacher or student logprobs in rows {rows[:5]}")
    ratio = torch.where(m > 0, diff, torch.zeros_like(diff))
    if clip is not None:
        ratio = ratio.clamp(-clip, clip)
    adv = discounted_sums(ratio, discount) if discount > 0 else ratio
    adv = kl_weight * adv
    if task_advantages is not None and reward_weight > 0:
        adv = adv + reward_weight * task_advantages.float().unsqueeze(-1)
    return torch.where(m > 0, adv, torch.zeros_like(adv))


def discounted_sums(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reverse discounted sums along the last axis: out_t = Σ_{k≥t} γ^(k−t) x_k.
    `[B, T]` in, `[B, T]` out."""
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1] - 1, -1, -1):
        running = x[:, t] + gamma * running
        out[:, t] = running
    return out
