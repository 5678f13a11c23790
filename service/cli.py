"""What `posttrain serve` does once its flags are read: load the service configuration,
start the roles and the registry (`state.ServiceState.start`), serve HTTP until
interrupted, and stop every role it started on every exit."""

from __future__ import annotations

import os
from pathlib import Path

from ..config.base import RecipeError
from ..config.service import load_service_config


def flag_overrides(model: str | None, engine: str | None) -> dict:
    """`--model` and `--engine` as blocks over the configuration file's."""
    out: dict = {}
    if model is not None:
        out["model"] = {"path": model}
    if engine is not None:
        out["rollout"] = {"engine": engine}
    return out


def serve(
    config: Path | None,
    overrides: dict,
    root: Path,
    host: str,
    port: int,
    address: str | None,
    echo=print,  # noqa: ANN001 (typer.echo or print)
) -> int:
    """Run the service; returns the exit code (2: a bad configuration, token or port,
    named). `port` 0 takes a free port; the address printed is the one listened on.

    Raises:
        RuntimeError: a role failed to start (the roles started before it are stopped).
    """
    import uvicorn

    from .app import create_app
    from .state import ServiceState
    from .status_view import clear_endpoint, write_endpoint

    token = os.environ.get("POSTTRAIN_SERVE_TOKEN") or f"tml-{os.urandom(16).hex()}"
    if not token.startswith("tml-"):
        echo("error: POSTTRAIN_SERVE_TOKEN must start with 'tml-' (the SDK's rule)")
        return 2
    try:
        cfg = load_service_config(config, overrides)
    except RecipeError as e:
        echo(f"error: {e}")
        return 2
    from ..common.model_registry import KNOWN_ALIASES, resolve_model_path

    path = Path(cfg.model.path).expanduser()
    if cfg.model.path not in KNOWN_ALIASES and not path.exists():
        echo(
            f"error: model.path (--model): {path} does not exist; give a built-in alias "
            f"({', '.join(sorted(KNOWN_ALIASES))}) or a transformers model folder"
        )
        return 2
    try:
        resolve_model_path(cfg.model.path)
    except FileNotFoundError as e:
        echo(f"error: model.path (--model): {e}")
        return 2
    from ..common.net import listen_socket

    try:  # bound before the roles start: a taken port costs no start-up
        sock = listen_socket(host, port)
    except OSError as e:
        echo(f"error: cannot listen on {host}:{port}: {e}")
        return 2
    port = sock.getsockname()[1]  # --port 0: the free port taken
    state = ServiceState.start(cfg, root, token, address)
    try:
        sock.listen(2048)  # from now on clients queue until uvicorn serves them
        echo(
            f"posttrain serve: http://{host}:{port} model {cfg.base_name} on "
            f"{state.stack.world} learner rank(s) and {len(state.stack.roles.rollout)} "
            f"{cfg.rollout.engine} engine(s); root {root}\n"
            f"  export TINKER_BASE_URL=http://{host}:{port} TINKER_API_KEY={token}"
        )
        write_endpoint(root, f"http://{host}:{port}")
        server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
        server.run(sockets=[sock])
    finally:
        clear_endpoint(root)
        state.stop()
    return 0
