"""`posttrain status --advise` on a synthetic run folder with hand-computed answers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posttrain.recipes.cli import app
from posttrain.recipes.loading import dump_recipe, load_recipe
from posttrain.recipes.monitoring.advice import advise, measured_phases
from tests.conftest import ROOT

QUICK = ROOT / "recipes" / "quickstart_grpo.yaml"


def _span(role: str, worker: int, kind: str, start: float, end: float, step: int) -> dict:
    return {"role": role, "worker": worker, "kind": kind, "start": start, "end": end, "step": step}


def _run_folder(tmp: Path, steps: int = 3, checkpoint_s: float | None = 20.0) -> Path:
    """2 engines, 1 learner rank: each step generate 3 s (both engines), train 8 s, push
    1 s, 0.5 s of other work: 12.5 s; step 0 (warm-up) takes twice as long."""
    recipe = load_recipe(
        QUICK, ["rollout.engine=hf", "resources.rollout.gpus=2", "resources.learner.gpus=1"]
    )
    (tmp / "recipe.yaml").write_text(dump_recipe(recipe))
    rows, spans, t = [], [], 1000.0
    for step in range(steps):
        k = 2.0 if step == 0 else 1.0
        for w in (0, 1):
            spans.append(_span("rollout", w, "generate", t, t + 3 * k - w * 0.5, step))
        spans += [
            _span("learner", 0, "forward", t + 3 * k, t + 5 * k, step),
            _span("learner", 0, "backward", t + 5 * k, t + 10 * k, step),
            _span("learner", 0, "optimizer", t + 10 * k, t + 11 * k, step),
        ]
        for role, w in (("learner", 0), ("rollout", 0), ("rollout", 1)):
            spans.append(_span(role, w, "weight_sync", t + 11 * k, t + 12 * k, step))
        rows.append({"step": step, "time/step": 12.5 * k})
        t += 12.5 * k
    rows.append({"step": steps, "eval/pass@1": 0.5})  # a final eval row has no time/step
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    if checkpoint_s is not None:
        for step, c in ((2, checkpoint_s - 2), (3, checkpoint_s + 2)):
            folder = tmp / "checkpoints" / f"step_{step:05d}"
            folder.mkdir(parents=True)
            (folder / "trainer_state.json").write_text(json.dumps({"step": step, "seconds": c}))
    return tmp


def test_phases_and_split_by_hand(tmp_path):
    run = _run_folder(tmp_path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    spans = [json.loads(x) for x in (run / "spans.jsonl").read_text().splitlines()]
    p = measured_phases(rows, spans, engines=2, learners=1)
    assert (p.generate, p.train, p.push, p.step, p.steps) == (3.0, 8.0, 1.0, 12.5, 2)
    assert p.other == pytest.approx(0.5)
    a = advise(run, rows, spans, 2, 1, 1, "gpu", mtbf_hours=4.0)
    # 1 engine: generate 6 s; 2 ranks: train 4 s; + push 1 + other 0.5 = 11.5 s
    assert (a.best.rollout, a.best.learner) == (1, 2)
    assert a.best.step == pytest.approx(11.5)
    assert a.current.step == pytest.approx(12.5)
    assert any(
        "resources.rollout.gpus: 1, resources.learner.gpus: 2" in x
        and "1.09x" in x
        and "8% shorter" in x
        for x in a.lines
    )
    # Young/Daly: C = mean(18, 22) = 20 s, MTBF 4 h: sqrt(2·20·14400) = 758.9 s = 61 steps
    assert a.checkpoint_s == pytest.approx(20.0)
    assert a.interval_s == pytest.approx(math.sqrt(2 * 20 * 14400))
    assert a.interval_steps == 61
    assert any("train.checkpoint_every: 61" in x for x in a.lines)


def test_a_balanced_run_keeps_its_split_and_no_checkpoint_says_so(tmp_path):
    run = _run_folder(tmp_path, checkpoint_s=None)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    spans = [json.loads(x) for x in (run / "spans.jsonl").read_text().splitlines()]
    # the same spans read as 2 engines + 2 ranks: 4 devices; 2:2 predicted 12.5 s, 1:3
    # 6 + 5.33 + 1.5 = 12.83 s, 3:1 2 + 16 + 1.5 = 19.5 s
    a = advise(run, rows, spans, 2, 1, 2, "cpu", mtbf_hours=None)
    assert (a.best.rollout, a.best.learner) == (2, 2)
    assert any(x.startswith("split: keep 2:2") for x in a.lines)
    assert any("resources.device cpu" in x for x in a.lines)
    assert a.interval_s is None and any("no measured checkpoint" in x for x in a.lines)
    with pytest.raises(ValueError, match="--mtbf"):
        advise(run, rows, spans, 2, 1, 2, "cpu", mtbf_hours=0)


def test_status_advise_cli(tmp_path):
    run = _run_folder(tmp_path)
    out = CliRunner().invoke(
        app, ["status", str(run), "--advise", "--mtbf", "4"], terminal_width=200
    )
    assert out.exit_code == 0, out.output
    assert "resources.rollout.gpus: 1, resources.learner.gpus: 2" in out.output
    assert "train.checkpoint_every: 61" in out.output
    plain = CliRunner().invoke(app, ["status", str(run)])
    assert "split:" not in plain.output


def test_dashboard_shows_the_advice(tmp_path):
    from posttrain.recipes.monitoring.dashboard import DashboardServer
    from tests.recipes.test_telemetry import _chromium_dom

    run = _run_folder(tmp_path)
    server = DashboardServer(run, 0)
    try:
        url = server.start()
        dom = _chromium_dom(url + "?mtbf=4")
    finally:
        server.stop()
    assert 'data-loaded="true"' in dom
    advice = re.findall(r'<li class="advice">([^<]*)</li>', dom)
    assert any("resources.rollout.gpus: 1, resources.learner.gpus: 2" in a for a in advice)
    assert any("train.checkpoint_every: 61" in a for a in advice)
