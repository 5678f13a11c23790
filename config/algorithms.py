"""Algorithm blocks of a recipe (`grpo:`, `ppo:`, `dpo:`, `reward_model:`), pydantic only."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict as _Strict
from .facts import AlgorithmFacts, Passes


class GRPOConfig(_Strict):
    clip_eps: float = Field(0.2, gt=0, description="Lower clip of the ratio: 1 - clip_eps.")
    clip_eps_high: float | None = Field(
        None, gt=0, description="Upper clip 1 + clip_eps_high (DAPO); default clip_eps."
    )
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the k3 KL to the frozen reference; 0 loads no reference."
    )
    estimator: Literal["grpo", "rloo", "reinforce_pp"] = Field(
        "grpo",
        description="Advantage estimator. grpo: group-centred rewards over the group's std "
        "(Shao et al. 2024, DeepSeekMath; scale_rewards and std_eps apply); rloo: reward minus "
        "the mean of the other samples of its group (Ahmadian et al. 2024, 'Back to Basics'); "
        "reinforce_pp: group-centred rewards over the std of the whole batch + std_eps "
        "(Hu 2025, REINFORCE++).",
    )
    loss: Literal["ppo_clip", "gspo", "cispo"] = Field(
        "ppo_clip",
        description="Policy loss. ppo_clip: token-level clipped ratio (PPO, Schulman et al. "
        "2017); gspo: one ratio per sequence, the geometric mean of its token ratios, clipped "
        "per sequence, averaged over sequences whatever their length (Zheng et al. 2025, "
        "GSPO); cispo: clipped, stop-gradient importance "
        "weight times advantage times logprob (MiniMax-M1, 2025). All clip with clip_eps / "
        "clip_eps_high.",
    )
    mask_truncated: bool = Field(
        False,
        description="Leave responses cut at rollout.max_new_tokens out of the loss, tokens "
        "and denominator alike (DAPO's overlong filtering, Yu et al. 2025).",
    )
    overlong_buffer: int | None = Field(
        None,
        gt=0,
        description="DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): responses longer "
        "than rollout.max_new_tokens − overlong_buffer lose up to overlong_penalty of reward, "
        "linearly over this many last tokens; null: off. Must be below max_new_tokens.",
    )
    overlong_penalty: float = Field(
        1.0,
        ge=0,
        description="The soft overlong punishment at the length limit (DAPO's "
        "penalty factor); used with overlong_buffer.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (Yu et al. 2025): drop groups whose rewards are "
        "all equal (no signal) and generate more prompts until the step has "
        "train.prompts_per_step groups with signal, at most max_rounds rounds "
        "(recipes/algo/dynamic.py). Metrics dynamic/dropped_groups and dynamic/rounds. "
        "With train.max_staleness >= 1 the producer keeps generating and drops the flat "
        "groups (counted in samples_dropped); a step waits for at most max_rounds x "
        "prompts_per_step groups.",
    )
    max_rounds: int = Field(
        3, gt=0, description="Most generate+score rounds per step with dynamic_sampling."
    )
    scale_rewards: bool = Field(
        True,
        description="estimator grpo: divide group-centred rewards by the group's std "
        "(False: Dr. GRPO).",
    )
    std_eps: float = Field(1e-6, gt=0, description="Added to the group std before dividing.")
    loss_agg: Literal["token_mean", "seq_mean_token_sum"] = Field(
        "token_mean",
        description="token_mean: mean over every response token of the step; "
        "seq_mean_token_sum: tokens summed per sequence, mean over sequences (Dr. GRPO). "
        "loss gspo does not read it: its objective is a mean over sequences (each "
        "sequence's clipped term once, its KL as a mean over its tokens); "
        "seq_mean_token_sum with gspo is refused.",
    )
    epochs: int = Field(1, gt=0, description="Passes over each step's rollouts.")
    mini_batches: int = Field(
        1,
        gt=0,
        description="Optimizer steps per epoch (the step's rollouts split into this "
        "many shuffled mini-batches). With epochs × mini_batches = 1 (the default) the "
        "batch gets one update from the policy that sampled it: the ratio is 1 and the clip "
        "cannot act. From the second update of a step on, the clip acts.",
    )
    old_logprob_pass: Literal["auto", "always"] = Field(
        "auto",
        description="auto: old_logprobs get their own no-grad forward only when a step takes "
        "several updates; with one, they are the update's own logprobs detached (same "
        "gradient, one forward less). always: the separate pass every step (for comparison; "
        "logprob_mismatch is then measured in eval mode, without adapter dropout).",
    )

    def facts(self) -> AlgorithmFacts:
        """GRPO: rollouts; a reference only with the KL on; old logprobs get their own
        pass when a step takes several updates (or `old_logprob_pass: always`)."""
        updates = self.epochs * self.mini_batches
        separate = updates > 1 or self.old_logprob_pass == "always"
        return AlgorithmFacts(
            data="rollouts",
            reference=self.kl_coef > 0,
            critic=False,
            updates_per_step=updates,
            old_logprob_pass=separate,
            passes=Passes(
                policy_forward=int(separate),
                reference_forward=int(self.kl_coef > 0),
                policy_train=self.epochs,
            ),
        )


class PPOConfig(_Strict):
    gamma: float = Field(1.0, ge=0, le=1, description="Discount γ over response tokens.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ (Schulman et al. 2016).")
    clip_eps: float = Field(0.2, gt=0, description="Policy ratio clip ε.")
    cliprange_value: float = Field(0.2, gt=0, description="Value clip around the old values.")
    epochs: int = Field(1, gt=0, description="Passes over each step's rollouts.")
    mini_batches: int = Field(2, gt=0, description="Optimizer steps per epoch.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the frozen reference.")
    kl_mode: Literal["reward", "loss"] = Field(
        "reward", description="reward: k1 per-token penalty in the reward; loss: k3 loss term."
    )
    whiten_advantages: bool = Field(
        True, description="Whiten advantages over the step's valid tokens."
    )
    bootstrap_truncated: bool = Field(
        False,
        description="A response cut at max_new_tokens bootstraps GAE from the critic's "
        "last value instead of 0.",
    )
    critic_lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the critic.")
    critic_path: str | None = Field(
        None,
        description="Initialise the critic from this transformers folder; default the "
        "policy's weights.",
    )

    def facts(self) -> AlgorithmFacts:
        """PPO: rollouts and a critic; every step runs the old-logprob, value (and, with
        the KL on, reference) forwards before its `epochs × mini_batches` updates, each of
        which trains the policy and the critic."""
        return AlgorithmFacts(
            data="rollouts",
            reference=self.kl_coef > 0,
            critic=True,
            updates_per_step=self.epochs * self.mini_batches,
            old_logprob_pass=True,
            passes=Passes(
                policy_forward=1,
                reference_forward=int(self.kl_coef > 0),
                critic_forward=1,
                policy_train=self.epochs,
                critic_train=self.epochs,
            ),
        )


class DPOConfig(_Strict):
    beta: float = Field(0.1, gt=0, description="β, the strength of the implicit KL constraint.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Assumed label-flip rate.")
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid (Rafailov et al. 2023, eq. 7) or ipo (Azar et al. 2023)."
    )
    ipo_token_mean: bool = Field(
        True,
        description="ipo: compare per-token mean logprobs of each reply (IPO's authors, "
        "TRL), so the target margin 1/(2β) does not depend on reply length; false: summed "
        "logprobs, as sigmoid DPO uses.",
    )
    precompute_ref_logprobs: bool = Field(
        True,
        description="Compute the reference's logprobs of every pair once, cache them on disk, "
        "and free the reference; false keeps the reference in the loop.",
    )
    max_length: int = Field(512, gt=8, description="Most tokens of prompt + reply per row.")
    chat_template: bool = Field(
        True,
        description="Render every pair with the model's chat template, as the reward model "
        "trains and the reward service scores (hh dialogues split into user/assistant "
        "turns, a text prompt as one user message; recipes/data/pair_tokens.py `render_pairs`); "
        "false: text pairs as raw text (+ EOS), as posttrain before 2026-12-01 did.",
    )

    def facts(self) -> AlgorithmFacts:
        """DPO: preference pairs and a reference, whose logprobs are precomputed once
        before training (or, without `precompute_ref_logprobs`, taken every step); one
        update per step."""
        return AlgorithmFacts(
            data="pairs",
            reference=True,
            critic=False,
            updates_per_step=1,
            old_logprob_pass=False,
            passes=Passes(reference_forward=int(not self.precompute_ref_logprobs)),
        )


class CorrectionConfig(_Strict):
    """`train.correction`: off-policy correction of GRPO and PPO losses between the engine
    that sampled (`inference_logprobs`) and the learner's `old_logprobs`
    (algorithms/correction.py)."""

    mode: Literal["none", "tis", "mis", "decoupled"] = Field(
        "none",
        description="none: the loss as without correction. tis: each token's policy loss "
        "times min(w, cap), w = exp(old_logprobs - inference_logprobs) (truncated importance "
        "sampling, Yao et al. 2025). mis: tokens (or whole responses) with w outside "
        "[1/cap, cap] leave the loss (masked importance sampling; verl rollout correction, "
        "IcePop). decoupled: AReaL's decoupled PPO (Fu et al. 2025): the clip acts around "
        "the proximal policy (old_logprobs, the learner's at the step's start) and each "
        "token's loss is weighted by w, untruncated, tokens with w > cap leaving the loss; "
        "token level, with a trust-region loss (grpo.loss ppo_clip or gspo, ppo, distill). "
        "Default: none with train.max_staleness 0; tis with train.max_staleness >= 1, "
        "where a sample from an older policy would otherwise train with the on-policy "
        "gradient; set none explicitly to train stale samples uncorrected.",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="token: one weight per token; sequence: one per response, "
        "exp of the sum of its token log-ratios, on every token of it.",
    )
    cap: float = Field(
        2.0,
        gt=1,
        description="C: TIS truncates at C; MIS keeps [1/C, C]; decoupled keeps w <= C "
        "(AReaL's behav_imp_weight_cap).",
    )


class RewardModelConfig(_Strict):
    """`algorithm: reward_model`: a scalar-head model on the policy's architecture trained
    on preference pairs with the Bradley-Terry loss −log σ(r_chosen − r_rejected − m)
    (Ouyang et al. 2022, eq. 1; margin m as in Llama 2), saved to RUN_DIR/final as an
    `AutoModelForSequenceClassification` folder that a `type: reward_model` reward serves."""

    margin: float = Field(
        0.0, ge=0, description="Constant margin m every pair must clear (0: InstructGPT)."
    )
    margin_key: str | None = Field(
        None,
        description="Row key of a per-pair margin ≥ 0 added to `margin` (Llama 2's "
        "preference-strength margin); null: none.",
    )
    max_length: int = Field(512, gt=8, description="Most tokens of prompt + reply per row.")
    chat_template: bool = Field(
        True,
        description="Render every pair with the model's chat template, as the reward "
        "service renders what it scores (hh dialogues split into user/assistant turns, a "
        "text prompt as one user message); false: raw text as DPO reads it.",
    )
    eval_pairs: int = Field(
        0,
        ge=0,
        description="Pairs held out (the last N after the seeded shuffle) and "
        "scored without training: eval/loss, eval/accuracy, eval/margin, eval/chosen, "
        "eval/rejected; 0: no eval split.",
    )
    eval_every: int = Field(
        10, gt=0, description="Score the held-out pairs every N steps and after the last."
    )

    def facts(self) -> AlgorithmFacts:
        """A reward model: preference pairs, no reference, one update per step, a
        scalar head."""
        return AlgorithmFacts(
            data="pairs",
            reference=False,
            critic=False,
            updates_per_step=1,
            old_logprob_pass=False,
            passes=Passes(),
            head="score",
        )
