"""What every environment reached over the network shares (`type: http`, `type:
openenv`): the bearer token, and one JSON request with the deadline, retries and size
bound of the recipe's `rollout.environment` (recipes/episodes/environments.py states the
rules)."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from ...common.http import DeadlineClient
from ...config.episodes import HttpEnvironment, OpenEnvEnvironment


class EnvironmentFailed(RuntimeError):
    """A user's environment failed after its retries; names the URL or class."""


def bearer_headers(config: HttpEnvironment | OpenEnvEnvironment) -> dict[str, str]:
    """`Authorization: Bearer <token>` from `config.token_env`, or no headers.

    Raises:
        EnvironmentFailed: `token_env` names an empty variable.
    """
    token = os.environ.get(config.token_env) if config.token_env else None
    if config.token_env and not token:
        raise EnvironmentFailed(
            f"rollout.environment.token_env: ${config.token_env} is "
            "empty; export the token or remove token_env"
        )
    return {"Authorization": f"Bearer {token}"} if token else {}


def request_json(
    http: DeadlineClient,
    config: HttpEnvironment | OpenEnvEnvironment,
    method: str,
    url: str,
    body: dict[str, Any] | None,
    model: type[BaseModel],
    who: str,
    backoff_s: float = 0.5,
) -> Any:
    """One request to an environment, its JSON answer validated as `model`: retried with
    exponential backoff (`backoff_s * 2**attempt`) on connection errors, timeouts, 5xx,
    408, 429 and malformed bodies, `config.retries` times; an answer over
    `config.max_message_bytes` and any other 4xx are not retried.

    Raises:
        EnvironmentFailed: after the last try, naming `url`, `who` and the last error.
    """
    last = ""
    for attempt in range(config.retries + 1):
        try:
            resp = http.request(method, url, json=body)
            resp.raise_for_status()
            if len(resp.content) > config.max_message_bytes:
                last = (
                    f"an answer of {len(resp.content):,} bytes, over max_message_bytes "
                    f"{config.max_message_bytes:,}"
                )
                break
            return model.model_validate(resp.json())
        except (httpx.HTTPError, ValidationError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
            status = e.response.status_code if isinstance(e, httpx.HTTPStatusError) else 0
            if 400 <= status < 500 and status not in (408, 429):
                break
            if attempt < config.retries:
                time.sleep(backoff_s * 2**attempt)
    raise EnvironmentFailed(f"environment {url} failed for {who}: {last}")
