"""The dashboard's reward-hacking panel in headless Chromium: each firing with its steps,
trajectory and samples, and a sample's text shown as text (model output is untrusted)."""

from __future__ import annotations

import json

from posttrain.recipes.monitoring.dashboard import DashboardServer

from .test_hacking_evidence import finished_run
from .test_telemetry import _chromium_dom

EXPLOIT = '<img src=x onerror="document.body.dataset.pwned=1">'


def test_panel_lists_firings_with_samples(tmp_path):
    run_dir = finished_run(tmp_path)
    line = json.loads((run_dir / "hacking.jsonl").read_text())
    line["samples"][0]["response"] = EXPLOIT
    (run_dir / "hacking.jsonl").write_text(json.dumps(line) + "\n")
    server = DashboardServer(run_dir, 0)
    try:
        dom = _chromium_dom(server.start())
    finally:
        server.stop()
    assert 'data-loaded="true"' in dom and "data-pwned" not in dom
    assert 'class="firing" data-code="hacking_hedged" data-first="4" data-last="5"' in dom
    assert "steps 4–5: hacking_hedged: 50% of the last 5 steps' samples" in dom
    assert dom.count('class="sample"') == len(line["samples"])
    assert '<pre class="sample-response">&lt;img src=x onerror=' in dom
    assert "<th>hack/hedged</th>" in dom and "<td>0.5</td>" in dom
