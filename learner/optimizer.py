"""One optimizer step of a learner rank: clip the gradients, refuse a non-finite step,
step AdamW (each optimizer) and the LR schedule.

The guard: a step whose loss (summed over the ranks) or any model's grad norm is NaN or
infinite is not applied. Its gradients are dropped (`zero_grad(set_to_none=True)`, so
AdamW's next step skips nothing it should not) and nothing else moves: the weights,
AdamW's moments and step counts, the LR schedule. One bad batch (a NaN reward, an
overflow in bf16) then costs one update, not the run: AdamW would otherwise write NaN
into every weight and moment it touches.

Collective: every rank calls it at once (the loss is all-reduced, the grad norms are
global DTensor norms), so all ranks decide alike.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


def adamw(params: list[torch.nn.Parameter], **kwargs: object) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel (one pass over each parameter, its gradient and
    both moments; CPU and CUDA, DTensor shards included) in place of the default
    `foreach` one, which makes several temporaries the size of the weights per step:
    on a 2-core CPU the 135M model's optimizer step took 0.17 s against 0.30 s
    (bench/learner.py, docs/benchmarks.md). Same update rule (Loshchilov & Hutter
    2019, torch.optim.AdamW's documented algorithm). `kwargs`: AdamW's (lr, betas,
    weight_decay)."""
    return torch.optim.AdamW(params, fused=True, **kwargs)


@dataclass(frozen=True)
class StepResult:
    """What one guarded step did.

    Attributes:
        applied: the update was applied (False: loss or a grad norm not finite).
        loss: the step's loss summed over the ranks.
        grad_norms: each model's global grad norm before clipping (policy first).
        lr: the policy's learning rate of this step.
    """

    applied: bool
    loss: float
    grad_norms: list[float]
    lr: float


def guarded_step(
    models: list[torch.nn.Module],
    optimizers: list[torch.optim.Optimizer],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
    loss: float,
) -> StepResult:
    """Clip each model's gradients to `max_grad_norm`, then step every optimizer and the
    scheduler, unless the step is not finite (module docstring). Gradients are dropped
    either way. Collective.

    Args:
        models: the trained models (policy, then critic), matching `optimizers`.
        loss: this rank's share of the step loss (the sum of its micro-batches').
    """
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    norms = []
    for model in models:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    lr = scheduler.get_last_lr()[0]
    applied = math.isfinite(total.item()) and all(math.isfinite(n) for n in norms)
    for opt in optimizers:
        if applied:
            opt.step()
        opt.zero_grad(set_to_none=True)
    if applied:
        scheduler.step()
    return StepResult(applied, total.item(), norms, lr)


def warn_skipped(step: int, done: StepResult) -> None:
    """Tell the console (stderr) that step `step`'s update was skipped, and why."""
    print(
        f"warning: step {step}: loss {done.loss} / grad_norm {done.grad_norms} "
        "is not finite; this optimizer update is skipped (weights, AdamW state "
        "and LR schedule unchanged; see skipped_updates). Check the rewards and "
        "advantages for NaN/inf, or lower train.lr.",
        file=sys.stderr,
        flush=True,
    )


def step_stats(done: StepResult) -> dict[str, float]:
    """A step's optimizer metrics: `grad_norm` (the policy's, before clipping), `lr`,
    `skipped_updates` (1: the update was not applied)."""
    return {
        "grad_norm": done.grad_norms[0],
        "lr": done.lr,
        "skipped_updates": 0.0 if done.applied else 1.0,
    }
