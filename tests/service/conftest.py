"""A live `posttrain serve` on a free port (uvicorn in a thread) in front of real roles
(a learner group and `hf` rollout engines in an embedded Ray cluster) serving the tiny
model as 'tiny', and the official `tinker` SDK pointed at it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

TOKEN = "tml-test-token"


def service_config(model: Path, learners: int = 1, engines: int = 1, **sessions: Any):  # noqa: ANN201
    from posttrain.config.service import ServiceConfig

    return ServiceConfig.model_validate(
        {
            "model": {"path": str(model), "name": "tiny", "dtype": "float32"},
            "rollout": {"engine": "hf"},
            "resources": {"learner": {"gpus": learners}, "rollout": {"gpus": engines}},
            "sessions": {"max_rank": 16, **sessions},
        }
    )


class Served(SimpleNamespace):
    """`.url`, `.state` (the `ServiceState`), `.stop()`."""


def serve(cfg: Any, root: Path) -> Served:
    """Start the roles and the HTTP server; `.stop()` ends both."""
    pytest.importorskip("tinker")
    import uvicorn

    from posttrain.common.net import listen_socket
    from posttrain.service.app import create_app
    from posttrain.service.state import ServiceState

    os.environ["TINKER_TELEMETRY"] = "0"
    state = ServiceState.start(cfg, root, TOKEN)
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        state.stop()

    return Served(url=url, state=state, stop=stop, root=root)


@pytest.fixture(scope="package")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One learner rank and one `hf` engine behind the service, shared by the package's
    modules (starting the roles is most of a module's time)."""
    s = serve(service_config(tiny_model), tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


@pytest.fixture(scope="package")
def client(served: Any):  # noqa: ANN201 (tinker.ServiceClient)
    import tinker

    c = tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
    yield c
    c.close("success").result(timeout=30)  # else its heartbeat warns after the server stops
