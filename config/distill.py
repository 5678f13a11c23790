"""The `distill:` block of a recipe: on-policy distillation (pydantic only, no torch).

The student (the recipe's `model`) samples on the rollout engines; a frozen teacher (a
local model folder with the student's tokenizer) scores every sampled token; the
student's per-token advantage is the negative reverse KL, teacher logprob − student
logprob (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", GKD with λ = 1 and the reverse KL; Thinking Machines,
"On-policy distillation", 2025), trained with the policy-gradient loss. The math is in
algorithms/distill.py, the step in recipes/algo/distill.py.
"""

from __future__ import annotations

from pydantic import Field

from .base import Strict as _Strict
from .facts import AlgorithmFacts, Passes


class DistillConfig(_Strict):
    teacher: str = Field(
        "",
        description="The teacher: a built-in model alias or a local transformers folder "
        "(another run's RUN_DIR/final, a policy folder saved by `posttrain export`, any "
        "model folder) whose tokenizer equals the student's (model.path); a different "
        "tokenizer is refused before start. Required with algorithm: distill.",
    )
    kl_weight: float = Field(
        1.0,
        gt=0,
        description="Weight of the per-token distillation advantage, "
        "kl_weight · (teacher logprob − student logprob).",
    )
    discount: float = Field(
        0.0,
        ge=0,
        le=1,
        description="γ: a token's advantage is Σ_{k≥t} γ^(k−t) (teacher − student)_k over "
        "the rest of its response. 0 (default, as Thinking Machines' on-policy "
        "distillation): each token learns from its own reverse KL only; 1: from the "
        "reverse KL of the whole continuation (the full sequence-level gradient of GKD).",
    )
    clip: float | None = Field(
        None,
        gt=0,
        description="Clip each token's teacher − student log-ratio to [−clip, clip] "
        "before discounting (a token the teacher finds very unlikely cannot dominate the "
        "step); null: no clip.",
    )
    reward_weight: float = Field(
        0.0,
        ge=0,
        description="Mix in the task reward: every token's advantage gets reward_weight × "
        "its sample's group-normalised reward advantage (GRPO's estimator, "
        "rollout.samples_per_prompt ≥ 2). 0: the rewards are only measured "
        "(reward_mean, eval pass@k), never trained on.",
    )
    clip_eps: float = Field(
        0.2,
        gt=0,
        description="Ratio clip of the policy-gradient loss (GRPO's ppo_clip surrogate). "
        "With one update per step the ratio is 1 and the clip cannot act: the loss is "
        "−A_t · logprob_t, the importance-sampling policy gradient on the student's own "
        "samples.",
    )

    def facts(self) -> AlgorithmFacts:
        """Distillation: rollouts; the frozen reference is the teacher (its own folder),
        run once per step over the batch (`ref_logprobs` = the teacher's logprobs); one
        update per step whose `old_logprobs` are its own forward; the teacher, not the
        reward, drives the advantage."""
        return AlgorithmFacts(
            data="rollouts",
            reference=True,
            critic=False,
            updates_per_step=1,
            old_logprob_pass=False,
            passes=Passes(reference_forward=1),
            teacher=self.teacher,
            reward_drives_advantage=False,
        )


def check_distill(algorithm: str, block: DistillConfig, samples_per_prompt: int) -> None:
    """Algorithm distill needs a teacher, and a reward mix needs groups to normalise
    rewards in.

    Raises:
        ValueError: names the key and what to set.
    """
    if algorithm != "distill":  # its keys elsewhere: Recipe._no_other_algorithms_block
        return
    if not block.teacher.strip():
        raise ValueError(
            "distill.teacher: algorithm distill needs a teacher; give a local model "
            "folder with the student's tokenizer, e.g. the quickstart's policy "
            "runs/quickstart-grpo/final"
        )
    if block.reward_weight > 0 and samples_per_prompt < 2:
        raise ValueError(
            f"distill.reward_weight is {block.reward_weight}, but rollout.samples_per_prompt "
            f"is {samples_per_prompt}: the reward advantage is normalised within a group "
            "of samples of one prompt, so one sample always gets 0; set "
            "rollout.samples_per_prompt: 2 or more, or distill.reward_weight: 0"
        )
