"""Idle-time accounting and where it goes: metrics.jsonl, spans.jsonl, TensorBoard,
Prometheus, W&B (offline), `posttrain status`, and the dashboard in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from fastapi.testclient import TestClient

from posttrain.common.telemetry import Span, busy_seconds, generation_tail, idle_fraction
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from posttrain.recipes.monitoring.advisories import advisory_ranges
from posttrain.recipes.monitoring.dashboard import DashboardServer, create_dashboard
from tests.conftest import ROOT


def test_idle_hand_computed():
    spans = [
        Span("rollout", 0, "generate", 0.0, 4.0, 0),
        Span("rollout", 0, "weight_sync", 3.0, 5.0, 0),
        Span("rollout", 1, "generate", 0.0, 2.0, 0),
    ]
    # worker 0 busy 5 s (overlap counted once), worker 1 busy 2 s, wall 10 s × 2 workers
    assert busy_seconds(spans, "rollout", 2, 0.0, 10.0) == pytest.approx(7.0)
    assert idle_fraction(spans, "rollout", 2, 0.0, 10.0) == pytest.approx(13 / 20)
    assert generation_tail(spans) == pytest.approx(2.0)


def _gap_idle(spans: list[dict], role: str, workers: int, start: float, end: float) -> float:
    """Idle seconds as the gaps between a worker's merged spans (independent of the
    implementation's union): the step's wall time not covered by any span."""
    total = 0.0
    for w in range(workers):
        cursor = start
        for s, e in sorted(
            (x["start"], x["end"]) for x in spans if x["role"] == role and x["worker"] == w
        ):
            s, e = min(max(s, start), end), min(e, end)  # clip to the step's window
            if s > cursor:
                total += s - cursor
            cursor = max(cursor, e)
        total += max(0.0, end - cursor)
    return total


def _recipe(tmp_path, tiny_model, name, **debug):
    f = tmp_path / f"{name}.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "algorithm": "grpo",
                "model": {"path": str(tiny_model), "dtype": "float32"},
                "data": {"train": {"generator": "arithmetic", "size": 8}},
                "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
                "rewards": [{"name": "len", "type": "length", "target_chars": 3}],
                "train": {"steps": 2, "prompts_per_step": 2},
                "resources": {"learner": {"gpus": 2}, "threads_per_worker": 1},
                "monitor": {"progress": False, "dashboard_port": 0, "tensorboard": True},
                "debug": debug,
            }
        )
    )
    return load_recipe(f)


@pytest.fixture(scope="module")
def slowed_runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("idle")
    out = {}
    for name, debug in (
        ("slow-learner", {"learner_delay_s": 3.0}),
        ("slow-rollout", {"rollout_delay_s": 3.0}),
    ):
        out[name] = (run(_recipe(tmp, tiny_model, name, **debug), tmp / name), tmp / name)
    return out


def test_slowing_one_side_moves_idle_to_the_other(slowed_runs):
    slow_l, slow_r = slowed_runs["slow-learner"][0], slowed_runs["slow-rollout"][0]
    for a, b in zip(slow_l, slow_r, strict=True):
        assert a["rollout_idle_fraction"] > b["rollout_idle_fraction"] + 0.2
        assert a["learner_idle_fraction"] < b["learner_idle_fraction"] - 0.2


def test_idle_plus_busy_is_wall_time(slowed_runs):
    for history, run_dir in slowed_runs.values():
        spans = [json.loads(x) for x in (run_dir / "spans.jsonl").read_text().splitlines()]
        for m in history:
            # The controller's own window: scoring starts time/generate after the step
            # (the first engine span starts later by a Ray call's latency, which grows
            # with the machine's load).
            scored = next(
                s["start"] for s in spans if s["step"] == m["step"] and s["kind"] == "score"
            )
            start = scored - m["time/generate"]
            end = start + m["time/step"]
            for side, workers in (("rollout", 1), ("learner", 2)):
                gaps = _gap_idle(spans, side, workers, start, end)
                wall = m["time/step"] * workers
                assert gaps + m[f"{side}_busy_s"] == pytest.approx(wall, rel=0.02)
                assert m[f"{side}_idle_fraction"] == pytest.approx(gaps / wall, abs=0.02)


def test_tensorboard_prometheus_and_status(slowed_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history, run_dir = slowed_runs["slow-learner"]
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    got = [e.value for e in acc.Scalars("rollout_idle_fraction")]
    assert got == pytest.approx([m["rollout_idle_fraction"] for m in history], abs=1e-6)
    text = TestClient(create_dashboard(run_dir)).get("/metrics").text
    value = float(re.search(r"^posttrain_learner_idle_fraction (\S+)$", text, re.M).group(1))
    assert value == pytest.approx(history[-1]["learner_idle_fraction"])
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.recipes.cli", "status", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "learner idle" in out.stdout and "mean" in out.stdout


def test_wandb_offline(tmp_path, monkeypatch):
    from posttrain.recipes.monitoring.log import StepLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml",
        ["monitor.wandb_project=posttrain-test", "monitor.tensorboard=false"],
    )
    log = StepLog(tmp_path, recipe)
    log.record(0, {"step": 0, "reward_mean": 0.5}, [])
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def _chromium_dom(url: str) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is missing; scripts/setup.sh installs it (apt-get install chromium)"
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--virtual-time-budget=8000",
        "--dump-dom",
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90).stdout


def test_dashboard_in_headless_chromium(slowed_runs, tmp_path):
    history, run_dir = slowed_runs["slow-rollout"]
    server = DashboardServer(run_dir, 0)
    try:
        dom = _chromium_dom(server.start())
    finally:
        server.stop()
    assert 'data-loaded="true"' in dom
    bars = re.findall(
        r'class="split-bar" data-step="(\d+)" data-kind="(\w+)" '
        r'data-seconds="([0-9.e-]+)"',
        dom,
    )
    assert len(bars) == 5 * len(history)
    for step, kind, seconds in bars:
        assert float(seconds) == pytest.approx(history[int(step)][f"time/{kind}"], rel=1e-6)
    points = re.findall(r'data-side="(\w+)" data-step="(\d+)" data-value="([0-9.e-]+)"', dom)
    assert len(points) == 2 * len(history)
    for side, step, value in points:
        assert float(value) == pytest.approx(history[int(step)][f"{side}_idle_fraction"])
    rows = set(re.findall(r'class="span" data-row="([\w:]+)"', dom))
    assert rows == {"rollout:0", "learner:0", "learner:1", "reward:0"}


def test_dashboard_charts_learning_and_lists_advisories(slowed_runs):
    history, run_dir = slowed_runs["slow-learner"]
    server = DashboardServer(run_dir, 0)
    try:
        dom = _chromium_dom(server.start())
    finally:
        server.stop()
    assert 'data-loaded="true"' in dom
    points = re.findall(
        r'class="metric-point" data-key="([\w/@]+)" data-step="(\d+)" '
        r'data-value="([0-9.e+-]+)"',
        dom,
    )
    charted = {k for k, _, _ in points}
    wanted = {
        "reward_mean",
        "response_length_mean",
        "truncated_fraction",
        "kl",
        "loss",
        "grad_norm",
        "reward/len",
    }
    assert wanted <= charted and wanted <= set(history[0])
    for key, step, value in points:
        assert float(value) == pytest.approx(history[int(step)][key], rel=1e-6, abs=1e-12)
    assert len([p for p in points if p[0] == "loss"]) == len(history)
    ticks = re.findall(r'class="x-tick">(\d+)<', dom)
    assert {"0", str(len(history) - 1)} <= set(ticks)  # axes labelled with step numbers
    listed = re.findall(r'<li class="advisory" data-first="(\d+)" data-last="(\d+)">', dom)
    assert listed == [(str(r.first), str(r.last)) for r in advisory_ranges(history)]
    if not listed:
        assert 'class="none"' in dom


def test_dashboard_summary_shows_the_final_eval_and_grouped_advisories(tmp_path):
    """A quickstart-shaped run: eval before step 0 (in step 0's row) and a final eval in
    a row of its own (step = train.steps, no time/step). The summary shows the newest
    eval's pass@1 / pass@k; 3 steps of one advisory are one row with the range."""
    from posttrain.recipes.loading import dump_recipe

    recipe = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml")
    (tmp_path / "recipe.yaml").write_text(dump_recipe(recipe))
    rows = [
        {
            "step": s,
            "policy_version": s + 1,
            "reward_mean": 0.25 * (s + 1),
            "accuracy": 0.25 * (s + 1),
            "time/step": 10.0,
            "time/generate": 4.0,
            "time/train": 5.0,
            "rollout_idle_fraction": 0.5,
            "learner_idle_fraction": 0.4,
            "advisories": [f"truncated: {60 - 10 * s}% of responses hit max_new_tokens"],
        }
        for s in range(3)
    ]
    rows[0].update({"eval/pass@1": 0.375, "eval/pass@k": 0.6875, "eval/k": 4.0})
    rows.append({"step": 3, "eval/pass@1": 0.625, "eval/pass@k": 0.9375, "eval/k": 4.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = DashboardServer(tmp_path, 0)
    try:
        dom = _chromium_dom(server.start())
    finally:
        server.stop()
    assert 'data-loaded="true"' in dom
    summary = dict(re.findall(r'<td class="v" id="sum-([\w]+)">([^<]*)</td>', dom))
    assert summary["eval_pass_1"] == "0.625" and summary["eval_pass_k"] == "0.938"
    assert summary["eval_step"] == "3" and summary["eval_k"] == "4"
    assert summary["steps"] == "3" and summary["reward_mean"] == "0.750"
    listed = re.findall(r'<li class="advisory" data-first="(\d+)" data-last="(\d+)">([^<]*)<', dom)
    assert listed == [("0", "2", "steps 0–2: truncated: 40% of responses hit max_new_tokens")]
