"""`posttrain status ROOT` for a service root: its sessions and models from the durable
registry (`root/service.json`) and, while the service runs (its address in
`root/endpoint.json`) and `$POSTTRAIN_SERVE_TOKEN` is its key, the live status route:
roles, verbs per rank and engine, idle fractions, queue depths."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from .registry import Registry

ENDPOINT = "endpoint.json"


def write_endpoint(root: Path, url: str) -> None:
    (root / ENDPOINT).write_text(json.dumps({"url": url, "pid": os.getpid()}))


def clear_endpoint(root: Path) -> None:
    (root / ENDPOINT).unlink(missing_ok=True)


def print_service_status(root: Path, echo: Callable[[str], object] = print) -> None:
    """Print the service root's sessions and models, then the live roles if reachable."""
    reg = Registry.load(root)
    echo(f"service root {root}: {len(reg.sessions)} session(s), {len(reg.models)} model(s)")
    echo("| model | session | rank | steps | saved at step |")
    echo("|---|---|---|---|---|")
    for m in reg.models.values():
        saved = m.saved_steps if m.saved else "-"
        echo(f"| {m.model_id} | {m.session_id} | {m.rank} | {m.steps} | {saved} |")
    path, token = root / ENDPOINT, os.environ.get("POSTTRAIN_SERVE_TOKEN")
    if not path.is_file():
        echo("not running (no endpoint.json)")
        return
    url = json.loads(path.read_text())["url"]
    if not token:
        echo(f"running at {url}; set POSTTRAIN_SERVE_TOKEN to show its roles and queues")
        return
    import httpx

    try:
        live = httpx.get(f"{url}/api/v1/status", headers={"X-API-Key": token}, timeout=5).json()
    except (httpx.HTTPError, ValueError) as e:
        echo(f"{url}: not answering ({type(e).__name__}); the service may have stopped")
        return
    roles = live.get("roles", {})
    echo(
        f"live at {url}: {roles.get('learner_ranks')} learner rank(s), "
        f"{roles.get('engines')} {roles.get('engine')} engine(s); idle fraction learner "
        f"{roles.get('learner_idle_fraction', 0):.2f} rollout "
        f"{roles.get('rollout_idle_fraction', 0):.2f}; queues {live.get('queues')}"
    )
    for who in ("learner_verbs", "engine_verbs"):
        for k, verbs in sorted(roles.get(who, {}).items()):
            echo(f"  {who.split('_')[0]} {k}: {verbs}")
