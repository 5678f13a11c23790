"""The recipe's `monitor:` block (console, dashboard, TensorBoard, W&B, rollout files,
health-advisory and reward-hacking thresholds) and `debug:` (test and drill knobs).
Pydantic only, no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import Strict as _Strict


class AdvisoriesConfig(_Strict):
    """Thresholds of the health advisories (recipes/monitoring/advisories.py), checked after every
    step; an advisory is listed in metrics.jsonl at each step that raises it and printed once,
    when it starts (`posttrain status` shows its step range)."""

    no_variance_groups: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Advise when this share of a step's groups or more has "
        "no reward variance (every sample scored the same: no GRPO signal).",
    )
    truncated: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Advise when this share of responses or more hit rollout.max_new_tokens.",
    )
    slow_step: float = Field(
        5.0,
        gt=1,
        description="Advise when a step takes this many times the median step time so far or more.",
    )
    failed_rewards: int = Field(
        1, ge=1, description="Advise when this many rollouts or more could not be scored."
    )
    logprob_mismatch: float = Field(
        0.1,
        gt=0,
        description="Advise when the mean |learner - engine| logprob of the "
        "sampled tokens is above this.",
    )
    idle: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Advise when a side (rollout or learner) is idle more "
        "than this share of the step ...",
    )
    idle_steps: int = Field(3, ge=1, description="... for this many steps in a row.")


class HackingConfig(_Strict):
    """Thresholds of the reward-hacking monitors (recipes/monitoring/hacking.py), checked
    after every step over the run's metrics so far. A trend compares the mean of the first
    `window` steps of the run (the baseline) with the mean of the last `window` steps; a
    monitor needs 2 × `window` steps before it can fire. The defaults fire on none of the
    shipped recipes' runs as measured (docs/operating.md)."""

    window: int = Field(5, ge=1, description="Steps averaged at each end of a trend.")
    rise_z: float = Field(
        3.0,
        gt=0,
        description="(1), (2): a rise counts when it is at least this many standard errors: "
        "the rise of a least-squares line fitted to the per-step values, against the "
        "scatter of those values about the line (one-sided p ≈ 0.01 at 3 with 10 steps).",
    )
    reward_rise: float = Field(
        0.15,
        gt=0,
        description="(1) heldout: the train reward (`reward_mean`, reward units) rose by at "
        "least this (and `rise_z` standard errors) between the first and the last "
        "held-out measurement ...",
    )
    heldout_share: float = Field(
        0.25,
        ge=0,
        description="... while the held-out metric rose by less than this share of the "
        "reward's rise (or fell): the policy gets better at the reward, not at the task.",
    )
    heldout_metric: str = Field(
        "eval/pass@1",
        min_length=1,
        description="The held-out metric of (1): `eval/pass@1` (the `eval:` block), or a "
        "stricter verifier logged every step, e.g. `reward/strict` of a weight-0 reward "
        "component named `strict`.",
    )
    component_rise: float = Field(
        0.2,
        gt=0,
        description="(2) component: one reward component (`reward/NAME`, its own units) "
        "rose by at least this (and `rise_z` standard errors) ...",
    )
    component_share: float = Field(
        0.25,
        ge=0,
        description="... while every other component rose by less than this share of "
        "that rise (or fell).",
    )
    length_ratio: float = Field(
        3.0,
        gt=1,
        description="(3) drift: mean response length grew to this many times its baseline.",
    )
    repetition_rise: float = Field(
        0.3,
        gt=0,
        le=1,
        description="(3) drift: the mean share of repeated 4-grams in a response "
        "(`repetition`, 0..1) rose by at least this.",
    )
    entropy_ratio: float = Field(
        5.0,
        gt=1,
        description="(3) drift: the policy's token entropy (`entropy`) fell to 1/this of "
        "its baseline or rose to this many times it.",
    )
    bypass_share: float = Field(
        0.2,
        gt=0,
        le=1,
        description="(4) bypass: the share of a step's samples with one verifier-bypass "
        "signature (`hack/*`: early exit, patched tests or builtins, many candidate "
        "answers, hedged answers), averaged over the last `window` steps, reached this.",
    )
    many_answers: int = Field(
        4,
        ge=2,
        description="(4) bypass: a response whose last line holds this many distinct "
        "numbers or more joined only by list separators (, ; / or and), or two different "
        "boxed answers, lists candidate answers.",
    )
    jump_ratio: float = Field(
        5.0,
        gt=1,
        description="(5) kl: `kl` or `logprob_mismatch` reached this many times the median "
        "of the `window` steps before it ...",
    )
    kl_floor: float = Field(
        0.1, gt=0, description="... and at least this (nats per token) for `kl` ..."
    )
    mismatch_floor: float = Field(
        0.05, gt=0, description="... or this for `logprob_mismatch` (mean |Δ logprob|)."
    )


def check_hacking(h: HackingConfig, reward_names: list[str], has_eval: bool) -> None:
    """Refuse a `monitor.hacking.heldout_metric` that no step would log (the held-out
    monitor would then never fire, silently).

    Raises:
        ValueError: names the key and the fix.
    """
    key = h.heldout_metric
    if key.startswith("reward/"):
        if key[7:] not in reward_names:
            raise ValueError(
                f"monitor.hacking.heldout_metric is {key!r}, but the recipe's rewards are "
                f"named {reward_names}; name one of them (a stricter verifier may be a "
                "component of weight 0: logged every step, not trained on)"
            )
    elif not key.startswith("eval/"):
        raise ValueError(
            f"monitor.hacking.heldout_metric is {key!r}; give eval/pass@1 (or another "
            "eval/ metric, with an eval: block) or reward/NAME (a reward component)"
        )
    elif not has_eval and "heldout_metric" in h.model_fields_set:
        raise ValueError(
            f"monitor.hacking.heldout_metric is {key!r}, but the recipe has no eval: block "
            "to measure it; add one, or name a stricter reward component (reward/NAME)"
        )


class MonitorConfig(_Strict):
    progress: bool = Field(True, description="Show a progress bar on the console.")
    dashboard_port: int | None = Field(
        8765,
        ge=0,
        le=65535,
        description="Live dashboard and Prometheus /metrics on 127.0.0.1:PORT (0: any free "
        "port; null: off).",
    )
    tensorboard: bool = Field(
        True, description="Write TensorBoard event files to RUN_DIR/tensorboard."
    )

    @field_validator("dashboard_port", mode="before")
    @classmethod
    def _no_bool_port(cls, v: object) -> object:
        if isinstance(v, bool):  # YAML's true/false would become port 1/0
            raise ValueError(
                f"a port number, 0 (any free port) or null (off), not {str(v).lower()}"
            )
        return v

    wandb_project: str | None = Field(
        None,
        description="Log every step to this Weights & Biases project (needs wandb; "
        "WANDB_MODE=offline works without network).",
    )
    save_rollouts: bool = Field(
        True, description="Write every step's rollouts and rewards to RUN_DIR/rollouts/."
    )
    advisories: AdvisoriesConfig = Field(default_factory=AdvisoriesConfig)
    hacking: HackingConfig = Field(default_factory=HackingConfig)
    on_hacking: Literal["warn", "checkpoint", "stop"] = Field(
        "warn",
        description="When a reward-hacking monitor starts firing: `warn` (the advisory and "
        "its evidence only), `checkpoint` (also save a checkpoint after the step, then go "
        "on), `stop` (save a checkpoint and stop the run, exit 1; resume with --resume).",
    )


class DebugConfig(_Strict):
    """Knobs for tests and benchmarks of the idle-time accounting; leave at 0."""

    learner_delay_s: float = Field(0.0, ge=0, description="Extra busy seconds per train_step.")
    rollout_delay_s: float = Field(0.0, ge=0, description="Extra busy seconds per generate.")
    rollout_tail_every: int = Field(
        0,
        ge=0,
        description="A long tail of generation times (bench/async.py): a sample whose "
        "uid hashes (SHA-256, first 4 bytes) to 0 modulo this (about one in N) is long, "
        "and a generate call holding one sleeps rollout_delay_s × rollout_tail_factor "
        "instead of rollout_delay_s (a batch waits for its longest sample). 0: off.",
    )
    rollout_tail_factor: float = Field(
        8.0, ge=1.0, description="How many times longer a long sample's call sleeps."
    )
    push_delay_s: float = Field(
        0.0,
        ge=0,
        description="Fault drills: extra seconds each engine spends taking a weight "
        "push (a window to signal the controller during push_weights).",
    )
    fail_weight_push: tuple[int, int] | None = Field(
        None,
        description="Fault drill: [engine, policy_version] — that engine refuses "
        "every push of that version (keeping its old weights).",
    )
