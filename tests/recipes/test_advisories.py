"""Health advisories on hand-made histories: each fires at its threshold, not below."""

from __future__ import annotations

from posttrain.config import AdvisoriesConfig
from posttrain.recipes.monitoring.advisories import (
    AdvisoryRange,
    advisories,
    advisory_ranges,
    console_lines,
)

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


def test_no_variance_is_no_fault_where_the_reward_does_not_drive_the_update():
    """Distillation learns from the teacher's logprobs; flat rewards are only measured."""
    from posttrain.config.distill import DistillConfig

    assert DistillConfig(teacher="t").facts().reward_drives_advantage is False
    flat = [healthy(groups_with_signal=0.0)]
    assert [a.split(":")[0] for a in advisories(flat, T, reward_signal=False)] == []
    assert codes(flat) == ["no_variance"]


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


def rows_with(*advised: list[str], start: int = 0) -> list[dict]:
    return [{"step": start + i, "advisories": a} for i, a in enumerate(advised)]


TR, FR = "truncated: 70% of responses", "failed_rewards: 2 rollouts"


def test_ranges_group_consecutive_steps_of_one_code():
    rows = rows_with([TR], [TR, FR], ["truncated: 40% of responses"], [], [], [TR])
    assert advisory_ranges(rows) == [
        AdvisoryRange("truncated", 0, 2, "truncated: 40% of responses"),  # the last message
        AdvisoryRange("failed_rewards", 1, 1, FR),
        AdvisoryRange("truncated", 5, 5, TR),
    ]
    assert [r.steps for r in advisory_ranges(rows)] == ["steps 0–2", "step 1", "step 5"]


def test_ranges_skip_the_eval_row_and_break_at_a_missing_step():
    twenty = rows_with(*[[TR]] * 20) + [{"step": 20, "eval/pass@1": 0.5}]
    assert advisory_ranges(twenty) == [AdvisoryRange("truncated", 0, 19, TR)]
    gap = [{"step": 3, "advisories": [TR]}, {"step": 5, "advisories": [TR]}]
    assert [r.steps for r in advisory_ranges(gap)] == ["step 3", "step 5"]
    assert advisory_ranges([]) == []
    assert advisory_ranges(rows_with([], [])) == []


def test_ranges_order_a_steps_codes_as_advisories_raises_them():
    rows = rows_with([FR], [TR, FR])  # failed_rewards opened first, truncated at step 1
    assert [r.code for r in advisory_ranges(rows)] == ["failed_rewards", "truncated"]
    both = rows_with([FR, TR])
    assert [r.code for r in advisory_ranges(both)] == ["truncated", "failed_rewards"]


def test_console_prints_one_line_per_range_at_its_start():
    """The quickstart's console printed "step 6: advisory no_variance: ..." and then
    "advisory no_variance: step 6" (or "steps 0–19" for a longer range): each advisory
    twice. One line per range, at its start."""
    run = rows_with([TR], [TR], [TR, FR], [], [TR])
    printed = [console_lines(run[: i + 1]) for i in range(len(run))]
    assert printed == [
        [f"step 0: advisory {TR}"],
        [],
        [f"step 2: advisory {FR}"],
        [],  # truncated's range 0–2 ended: not printed again
        [f"step 4: advisory {TR}"],  # a new range
    ]
    twenty = rows_with(*[[TR]] * 20)
    assert [console_lines(twenty[: i + 1]) for i in range(20)] == [[f"step 0: advisory {TR}"]] + [
        []
    ] * 19
    assert console_lines([]) == []
    nv = "no_variance: every group of step 6 has one reward; nothing to learn from"
    assert console_lines(rows_with([], [], [], [], [], [], [nv])) == [f"step 6: advisory {nv}"]


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
        [sys.executable, "-m", "posttrain.recipes.cli", "status", str(tmp_path), "--last", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "  step 2: failed_rewards: 3 rollouts" in out.stdout
    assert "truncated" not in out.stdout  # step 0 is not shown (2 training steps, the eval)
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


def test_status_shows_a_repeated_advisory_once_with_its_steps(tmp_path):
    """20 steps that each raise `truncated` (the quickstart before its fix) are one line
    with the step range and the newest numbers, not 20 lines."""
    import json

    from typer.testing import CliRunner

    from posttrain.recipes.cli import app

    rows = [
        {
            "step": s,
            "reward_mean": 0.5,
            "time/step": 10.0,
            "advisories": [f"truncated: {75 - s}% of responses hit max_new_tokens"],
        }
        for s in range(20)
    ]
    rows[12]["advisories"].append("slow_step: step took 30.0 s")
    rows.append({"step": 20, "eval/pass@1": 0.625, "eval/pass@k": 0.9375})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = CliRunner().invoke(app, ["status", str(tmp_path), "--last", "20"], terminal_width=200)
    assert out.exit_code == 0, out.output
    listed = out.output.split("advisories (monitor.advisories sets the thresholds):\n")[1]
    assert listed.splitlines() == [
        "  steps 0–19: truncated: 56% of responses hit max_new_tokens",
        "  step 12: slow_step: step took 30.0 s",
    ]
    # a range that started before the shown steps is shown whole
    out = CliRunner().invoke(app, ["status", str(tmp_path), "--last", "3"], terminal_width=200)
    assert "  steps 0–19: truncated: 56%" in out.output and "slow_step" not in out.output


def test_dashboard_api_groups_advisories(tmp_path):
    import json

    from fastapi.testclient import TestClient

    from posttrain.recipes.monitoring.dashboard import create_dashboard

    rows = rows_with([TR], [TR], [TR, FR]) + [{"step": 3, "eval/pass@1": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = TestClient(create_dashboard(tmp_path)).get("/api/advisories").json()
    assert got == [
        {"code": "truncated", "first": 0, "last": 2, "steps": "steps 0–2", "message": TR},
        {"code": "failed_rewards", "first": 2, "last": 2, "steps": "step 2", "message": FR},
    ]
