"""Health advisories on hand-made histories: each fires at its threshold, not below."""

from __future__ import annotations

from posttrain.config import AdvisoriesConfig
from posttrain.recipes.monitoring.advisories import advisories, new_advisories

T = AdvisoriesConfig()


def codes(history: list[dict], t: AdvisoriesConfig = T) -> list[str]:
    return [a.split(":", 1)[0] for a in advisories(history, t)]


def healthy(**over: float) -> dict:
    row = {
        "groups_scored": 4.0,
        "groups_with_signal": 4.0,
        "truncated_fraction": 0.0,
        "time/step": 1.0,
        "failed_scores": 0.0,
        "logprob_mismatch": 0.01,
        "rollout_idle_fraction": 0.5,
        "learner_idle_fraction": 0.5,
    }
    return {**row, **over}


def test_healthy_and_empty_raise_nothing():
    assert advisories([], T) == []
    assert codes([healthy(), healthy()]) == []
    assert codes([{"loss": 0.3, "time/step": 1.0}]) == []  # DPO: no rollout metrics


def test_no_variance_at_half_the_groups():
    assert codes([healthy(groups_with_signal=2.0)]) == ["no_variance"]  # 2 of 4 = 50%
    assert codes([healthy(groups_with_signal=3.0)]) == []  # 25%


def test_truncated_at_a_quarter():
    assert codes([healthy(truncated_fraction=0.25)]) == ["truncated"]
    assert codes([healthy(truncated_fraction=0.24)]) == []


def test_slow_step_against_median_so_far():
    past = [healthy(**{"time/step": s}) for s in (1.0, 2.0, 100.0)]  # median 2 s
    assert codes([*past, healthy(**{"time/step": 10.0})]) == ["slow_step"]
    assert codes([*past, healthy(**{"time/step": 9.9})]) == []
    assert codes([healthy(**{"time/step": 50.0})]) == []  # first step: no median yet


def test_any_failed_reward_and_mismatch_bound():
    assert codes([healthy(failed_scores=1.0)]) == ["failed_rewards"]
    assert codes([healthy(logprob_mismatch=0.11)]) == ["logprob_mismatch"]
    assert codes([healthy(logprob_mismatch=0.1)]) == []
    assert codes([healthy(logprob_mismatch=0.2)], AdvisoriesConfig(logprob_mismatch=0.5)) == []
    [synchronous] = advisories([healthy(logprob_mismatch=0.11)], T)
    assert "check model.dtype" in synchronous
    [stale] = advisories([healthy(logprob_mismatch=0.11, staleness_max=1.0)], T)
    assert "1 policy versions old" in stale and "train.correction" in stale


def test_idle_side_needs_n_steps_in_a_row():
    idle = healthy(learner_idle_fraction=0.95)
    assert codes([idle, idle]) == []
    assert codes([idle, idle, idle]) == ["learner_idle"]
    assert codes([idle, healthy(), idle, idle]) == []
    assert codes([idle, idle], AdvisoriesConfig(idle_steps=2)) == ["learner_idle"]
    busy_r = healthy(rollout_idle_fraction=0.91)
    assert codes([busy_r] * 3) == ["rollout_idle"]


def test_new_advisories_prints_only_what_started():
    a, b = "truncated: 30% ...", "failed_rewards: 2 ..."
    assert new_advisories([a, b], ["truncated: 40% ..."]) == [b]
    assert new_advisories([a], []) == [a]


def test_status_prints_the_shown_steps_advisories(tmp_path):
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    rows = [
        {"step": 0, "reward_mean": 0.5, "advisories": ["truncated: 50% of responses"]},
        {"step": 1, "reward_mean": 0.6, "advisories": []},
        {"step": 2, "reward_mean": 0.7, "advisories": ["failed_rewards: 3 rollouts"]},
        {"step": 3, "eval/pass@1": 0.25, "eval/pass@k": 0.625},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.recipes.cli", "status", str(tmp_path), "--last", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "step 2: failed_rewards: 3 rollouts" in out.stdout
    assert "truncated" not in out.stdout  # step 0 is not shown
    assert "eval p@k" in out.stdout and "0.625" in out.stdout


def test_status_counts_training_steps_and_leaves_evals_out_of_the_mean(tmp_path):
    """An asynchronous run with a final evaluation row: the title counts training steps,
    the mean row says over how many, pass@1 of two policies is not averaged, and the
    generate column is the learner's wait (generation runs behind training)."""
    import json

    from typer.testing import CliRunner

    from posttrain.recipes.cli import app

    rows = [
        {
            "step": 0,
            "reward_mean": 0.25,
            "time/step": 4.0,
            "time/generate": 1.0,
            "staleness_mean": 0.0,
            "eval/pass@1": 0.125,
            "eval/pass@k": 0.5,
        },
        {
            "step": 1,
            "reward_mean": 0.75,
            "time/step": 6.0,
            "time/generate": 0.0,
            "staleness_mean": 1.0,
        },
        {"step": 2, "eval/pass@1": 0.875, "eval/pass@k": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = CliRunner().invoke(app, ["status", str(tmp_path)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert f"{tmp_path.name}: 2 steps" in out.output
    assert "gen wait s" in out.output and "stale" in out.output
    mean = next(line for line in out.output.splitlines() if "mean of 2" in line)
    assert "0.500" in mean and "5.0" in mean  # reward and step time over the 2 steps
    assert "0.875" not in mean and "0.125" not in mean  # eval columns: no mean


def test_skipped_updates_any_at_all():
    assert codes([healthy(skipped_updates=0.0)]) == []
    [text] = advisories([healthy(skipped_updates=2.0)], T)
    assert text.startswith("skipped_updates: 2 optimizer update(s)") and "NaN" in text
