"""The `judge` reward component: an LLM judge behind any OpenAI-compatible
chat-completions endpoint (vLLM, SGLang, llama.cpp server, OpenAI), called from the
reward service, one request per item (the service's `workers` threads run items in
parallel).

Request: `POST {url}/chat/completions` with `{"model", "messages": [system?, user],
"max_tokens", "temperature"}`, the user message being `template` filled with the item's
fields (`{question}`, `{prompt}`, `{response}`, `{ground_truth}`, `{metadata}`). Reply:
`choices[0].message.content`; the last match of `score_pattern` gives the score (its
first group), mapped to [0, 1] when `score_range` is set.

Failures: a connection error, timeout, HTTP 5xx / 408 / 429 or a malformed body is
retried with exponential backoff, `retries` times; another 4xx is not. `timeout_s`
bounds each whole request, however slowly the judge sends its reply (common/http.py).
After the last try, or when the reply holds no score (or one outside `score_range`, or
one that is not a finite number: `nan`, `inf`, 400 digits), the item fails (`reward:
null`, the error in the item's `error`), and the run's `on_reward_failure` decides.
Limits: the judge sees model output verbatim (prompt injection is its problem, not the
service's); no response caching.
"""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any

import httpx

from ..common.http import DeadlineClient
from ..common.numbers import finite32
from ..config.rewards import JudgeReward
from .protocol import ScoreItem


class JudgeError(RuntimeError):
    """The judge could not score an item (after retries, or an unparsable reply)."""


def question_of(item: ScoreItem) -> str:
    """The last user message of the item's `messages`, else its `prompt`."""
    users = [m["content"] for m in item.messages or [] if m.get("role") == "user"]
    return users[-1] if users else item.prompt


def parse_score(text: str, pattern: str, score_range: tuple[float, float] | None) -> float:
    """The last match of `pattern` (its first group) in `text`, as a float, mapped
    linearly from `score_range` to [0, 1] when given.

    Raises:
        JudgeError: no match, a match that is not a finite number, or a score outside
            `score_range`.
    """
    found = re.findall(pattern, text)
    if not found:
        raise JudgeError(
            f"no score in the judge's reply ({pattern!r} did not match): {text[-200:]!r}"
        )
    last = found[-1]
    text = last[0] if isinstance(last, tuple) else last
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not finite32(value):
        raise JudgeError(f"the judge's score {text[:40]!r} is not a finite number")
    if score_range is None:
        return value
    low, high = score_range
    if not low <= value <= high:
        raise JudgeError(f"judge score {value} is outside score_range [{low}, {high}]")
    return (value - low) / (high - low)


class JudgeScorer:
    """Scores one item per call against `spec`'s endpoint.

    Raises (at construction):
        ValueError: `spec.token_env` names an unset variable.
    """

    def __init__(self, spec: JudgeReward, backoff_s: float = 0.5):
        self.spec, self.backoff_s = spec, backoff_s
        headers = {}
        if spec.token_env:
            token = os.environ.get(spec.token_env)
            if not token:
                raise ValueError(
                    f"reward {spec.name!r}: environment variable "
                    f"{spec.token_env} (token_env) is not set"
                )
            headers["Authorization"] = f"Bearer {token}"
        self.http = DeadlineClient(spec.timeout_s, headers)

    def request(self, item: ScoreItem) -> dict[str, Any]:
        """The chat-completions body for `item`.

        Raises:
            JudgeError: the template names a field the item does not have.
        """
        s = self.spec
        try:
            text = s.template.format(
                question=question_of(item),
                prompt=item.prompt,
                response=item.response,
                ground_truth=item.ground_truth or "",
                metadata=item.metadata,
            )
        except (KeyError, IndexError, AttributeError) as e:
            raise JudgeError(f"template field {e} is missing for this item") from e
        messages = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
        return {
            "model": s.model,
            "messages": messages + [{"role": "user", "content": text}],
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
        }

    def _reply(self, body: dict[str, Any]) -> str:
        last = ""
        for attempt in range(self.spec.retries + 1):
            try:
                resp = self.http.post(f"{self.spec.url}/chat/completions", json=body)
                resp.raise_for_status()
                content = resp.json()["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    raise ValueError(f"message content is {type(content).__name__}, not text")
                return content
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                last = f"{type(e).__name__}: {e}"
                status = e.response.status_code if isinstance(e, httpx.HTTPStatusError) else 0
                if 400 <= status < 500 and status not in (408, 429):
                    break  # the request itself is wrong; repeating it cannot help
                if attempt < self.spec.retries:
                    time.sleep(self.backoff_s * 2**attempt)
        raise JudgeError(f"judge request failed: {last}")

    def __call__(self, item: ScoreItem) -> tuple[float, dict[str, Any]]:
        """`(score, {"reply": the judge's text})`.

        Raises:
            JudgeError: see the module docstring.
        """
        reply = self._reply(self.request(item))
        return parse_score(reply, self.spec.score_pattern, self.spec.score_range), {
            "reply": reply[-500:]
        }

    def close(self) -> None:
        self.http.close()
