"""`rollout.environment.serve`: posttrain starts the environment server itself, for the
run, on this machine (no Docker), and stops it when the run ends; pydantic only.

The server is a command (`serve.command`, an argv); `{port}` in its arguments and in
`rollout.environment.url` becomes one free port of 127.0.0.1; a first argument `python`
runs the interpreter posttrain runs on (so the server sees the same packages).
recipes/roles/env_server.py starts it.
"""

from __future__ import annotations

import shutil
from urllib.parse import urlsplit

from pydantic import Field

from .base import Strict

#: What `{port}` in `serve.command` and `url` becomes: a free port chosen at start.
PORT = "{port}"
#: Hosts a server started on this machine can be reached at.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


class EnvironmentServe(Strict):
    """How posttrain starts the environment server of a run (see the module docstring):
    before the rollout workers and learners; its `GET {url}{health_path}` must answer 200
    within `ready_timeout_s`, else the run fails before any model loads; its output goes
    to `environment_server.log` in the run folder; it is stopped (its whole process
    group) when the run ends, however it ends."""

    command: list[str] = Field(
        min_length=1,
        description="argv of the server, e.g. ['python', 'examples/openenv_game.py', "
        "'--port', '{port}']; '{port}' becomes a free port (use it in url too); 'python' "
        "first runs posttrain's interpreter. Relative paths are from the current folder.",
    )
    ready_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Most seconds the server may take to answer its health check; over it "
        "(or if it exits first) the run fails, naming its log.",
    )
    health_path: str = Field(
        "/health", description="Path answered with 200 once the server is ready."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables added for the server."
    )


def check_serve(url: str, serve: EnvironmentServe | None, key: str = "rollout.environment") -> None:
    """Refuse a `url` / `serve` pair the run cannot start or reach.

    Raises:
        ValueError: names the key (`{key}.url`, `{key}.serve...`) and the fix.
    """
    if serve is None:
        if PORT in url:
            raise ValueError(
                f"{key}.url {url!r} has {PORT}, which only {key}.serve fills (with the port "
                f"of the server posttrain starts); add serve: {{command: [...]}} or give the port"
            )
        return
    in_command = any(PORT in a for a in serve.command)
    if (PORT in url) != in_command:
        has, lacks = ("url", "serve.command") if PORT in url else ("serve.command", "url")
        raise ValueError(
            f"{key}.{has} has {PORT} but {key}.{lacks} has not: the server and the client "
            f"must get the same free port; put {PORT} in both (url: http://127.0.0.1:{PORT})"
        )
    parts = urlsplit(url.replace(PORT, "1"))
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as e:
        raise ValueError(f"{key}.url {url!r}: {e}") from None
    if parts.scheme not in ("http", "https", "ws", "wss") or parts.hostname not in LOCAL_HOSTS:
        raise ValueError(
            f"{key}.url {url!r}: {key}.serve starts the server on this machine, so url "
            f"must be http://127.0.0.1:PORT (or localhost)"
        )
    if not serve.health_path.startswith("/"):
        raise ValueError(f"{key}.serve.health_path {serve.health_path!r} must start with '/'")
    program = serve.command[0]
    if program != "python" and shutil.which(program) is None:
        raise ValueError(
            f"{key}.serve.command[0] {program!r} is not a program on PATH (nor an "
            f"executable file); give its path, or 'python' for posttrain's interpreter"
        )
