"""A live `posttrain serve` on a free port (uvicorn in a thread) serving the tiny model,
and the official `tinker` SDK pointed at it."""

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


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A service serving the tiny model as 'tiny': `.url`, and `.state` (its in-memory
    sessions and models, for checksums)."""
    pytest.importorskip("tinker")
    import uvicorn

    from posttrain.common.net import listen_socket
    from posttrain.service.app import create_app

    os.environ["TINKER_TELEMETRY"] = "0"
    app = create_app(TOKEN, tmp_path_factory.mktemp("serve"), {"tiny": tiny_model})
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield SimpleNamespace(url=url, state=app.state.service)
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(served: Any):  # noqa: ANN201 (tinker.ServiceClient)
    import tinker

    return tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
