"""The run dashboard: a small FastAPI app over a run folder.

It reads `metrics.jsonl` and `spans.jsonl` on every request, so the same app serves a
live run (the controller starts it in a thread at launch) and a finished one
(`posttrain dashboard RUN_DIR`). Routes: `/` the page (a summary with the newest eval's
pass@1 / pass@k, per-step stacked time split, idle fractions over steps, learning
metrics over steps (reward, per component, accuracy, eval pass@k, length, truncation,
KL, loss, grad norm, logprob mismatch), the advisories (one row per run of consecutive
steps), the reward-hacking firings with their trajectory and sample rollouts
(recipes/monitoring/evidence.py), the advice of recipes/monitoring/advice.py (split,
checkpoint interval; the page's `?mtbf=HOURS` sets the MTBF), a Gantt timeline of the
last steps with one row per worker), `/api/metrics`, `/api/spans?last=N`,
`/api/advisories` (grouped by recipes/monitoring/advisories.py `advisory_ranges`),
`/api/hacking` (the firings with their evidence), `/api/advice?mtbf=H`, and Prometheus
`/metrics` with the last step's numbers as gauges. Binds 127.0.0.1 only: it has no
authentication.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, PlainTextResponse

from .advisories import advisory_ranges
from .evidence import hacking_ranges
from .log import METRICS_FILE, SPANS_FILE, read_jsonl

PAGE = Path(__file__).with_name("dashboard.html")


def _prometheus(rows: list[dict[str, Any]]) -> str:
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    if rows:
        for key, value in rows[-1].items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                name = "posttrain_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                Gauge(name, f"last step's {key}", registry=registry).set(value)
    return generate_latest(registry).decode()


def create_dashboard(run_dir: Path) -> FastAPI:
    """The dashboard app for `run_dir`."""
    app = FastAPI(title=f"posttrain dashboard: {run_dir.name}")

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.read_text().replace("{{RUN}}", run_dir.name)

    @app.get("/api/metrics")
    def metrics() -> list[dict[str, Any]]:
        return read_jsonl(run_dir / METRICS_FILE)

    @app.get("/api/spans")
    def spans(last: int = 3) -> list[dict[str, Any]]:
        rows = read_jsonl(run_dir / SPANS_FILE)
        if not rows:
            return []
        newest = max(r["step"] for r in rows)
        return [r for r in rows if r["step"] > newest - last]

    @app.get("/api/advisories")
    def advisories() -> list[dict[str, Any]]:
        return [r.to_dict() for r in advisory_ranges(read_jsonl(run_dir / METRICS_FILE))]

    @app.get("/api/hacking")
    def hacking() -> list[dict[str, Any]]:
        return hacking_ranges(read_jsonl(run_dir / METRICS_FILE), run_dir)

    @app.get("/api/advice")
    def advice(mtbf: float | None = None) -> dict[str, Any]:
        from .advice import advise_run

        if mtbf is not None and mtbf <= 0:
            return {"lines": [f"mtbf must be > 0 hours, got {mtbf}"]}
        return {"lines": advise_run(run_dir, read_jsonl(run_dir / METRICS_FILE), mtbf).lines}

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> str:
        return _prometheus(read_jsonl(run_dir / METRICS_FILE))

    return app


class DashboardServer:
    """uvicorn serving the dashboard from a daemon thread (for a live run)."""

    def __init__(self, run_dir: Path, port: int):
        import uvicorn

        config = uvicorn.Config(
            create_dashboard(run_dir), host="127.0.0.1", port=port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="dashboard")

    def start(self, timeout_s: float = 10.0) -> str:
        """Start serving; returns the URL.

        Raises:
            RuntimeError: the port is taken or the server did not start in time.
        """
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    "the dashboard could not start; is monitor.dashboard_port "
                    "taken? set another port, 0 for any, or null to turn it off"
                )
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
