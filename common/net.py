"""Small network helpers every role may use.

Servers here (reward services, the agent endpoint, the dashboard) listen with
`SO_REUSEADDR`, as uvicorn does: a port whose last owner just died, leaving its
connections in FIN_WAIT / TIME_WAIT for about a minute, can be listened on again at
once (a crashed reward service restarts on its own port), while a port another process
still listens on stays refused.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (`host`, `port`) with SO_REUSEADDR, not yet listening
    (uvicorn's `Server.run(sockets=[...])` listens on it); port 0 takes a free one.

    Raises:
        OSError: `host` is not an address of this machine, or another process
            listens on the port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
