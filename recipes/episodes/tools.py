"""Tools the model may call inside an episode (`rollout.tools`), and the environment
that runs them.

Tool calls are parsed from the Hermes / ChatML format that Qwen2.5, SmolLM2-style and
most tool-calling templates use:
`<tool_call>{"name": "python", "arguments": {"code": "print(2 + 2)"}}</tool_call>`.
A turn without `<tool_call>` is the model's final answer (the episode ends). A call
that is not valid JSON, has no `name` or `arguments`, names an unknown tool, or is
left unclosed gets an error message as its result (counted in `tool_errors`); the
episode goes on, nothing crashes.

Results come back as `{"role": "tool", "content": ...}` messages; the chat template
renders them (ChatML: `<|im_start|>tool ...`; Qwen2.5: a `<tool_response>` block).

The `python` tool runs the code in the code reward's sandbox (rewards/sandbox.py,
bubblewrap: no network, read-only system, rlimits, wall-clock timeout; see what it does
*not* protect against there). Its output (stdout, then stderr) is cut to
`max_output_tokens` tokens of the policy's tokenizer, the cut marked.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Collection
from typing import Any

from ...actors.rollout import PromptRequest
from ...config.episodes import PythonTool
from ...rewards.sandbox import Limits, make_sandbox
from .multiturn import StepResult

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TRUNCATED_MARK = "\n[... output truncated]"


class ToolCallError(ValueError):
    """A malformed tool call; the message is what the model reads as the result."""


def parse_tool_calls(text: str) -> list[dict[str, Any] | ToolCallError]:
    """The tool calls in a model turn's text, in order: `{"name", "arguments"}` dicts,
    or a `ToolCallError` in place of each malformed one. Empty when the text holds no
    `<tool_call>` (a final answer). `arguments` may be an object or a JSON string of
    one (OpenAI style)."""
    calls: list[dict[str, Any] | ToolCallError] = []
    for body in _CALL.findall(text):
        calls.append(_parse_one(body.strip()))
    if text.count("<tool_call>") > len(calls):
        calls.append(
            ToolCallError(
                "error: <tool_call> without </tool_call>; write "
                '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'
            )
        )
    return calls


def _parse_one(body: str) -> dict[str, Any] | ToolCallError:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"error: the tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError('error: a tool call needs {"name": str, "arguments": {...}}')
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCallError("error: the tool call's arguments are not a JSON object")
    if not isinstance(args, dict):
        return ToolCallError("error: the tool call's arguments are not a JSON object")
    return {"name": call["name"], "arguments": args}


def cap_tokens(text: str, tokenizer: Any, max_tokens: int) -> str:
    """`text` cut to its first `max_tokens` tokens, plus `TRUNCATED_MARK` when cut."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]) + TRUNCATED_MARK


class PythonToolRunner:
    """Runs `python` tool calls in one sandbox (shared by every episode, thread-safe:
    each run is its own process).

    Raises (at construction):
        SandboxUnavailable: `sandbox: bwrap` cannot start here (the message says why).
    """

    def __init__(self, config: PythonTool, tokenizer: Any):
        self.config = config
        self.tokenizer = tokenizer
        self.sandbox = make_sandbox(config.sandbox)
        self.limits = Limits(
            wall_s=config.timeout_s,
            cpu_s=max(1, math.ceil(config.timeout_s)),
            memory_mb=config.memory_mb,
            max_output_bytes=64 * 1024,
        )

    def __call__(self, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(result text, ok) of running `arguments['code']`."""
        code = arguments.get("code")
        if not isinstance(code, str):
            return 'error: the python tool takes {"code": "<program>"}', False
        res = self.sandbox.run(code, None, self.limits)
        if res.timed_out:
            return f"[timed out after {self.config.timeout_s:g} s]", False
        out = res.stdout + (res.stderr if res.stderr else "")
        if res.returncode != 0 and not res.stderr:
            out += f"[exit code {res.returncode}]"
        return cap_tokens(out, self.tokenizer, self.config.max_output_tokens), res.returncode == 0


class ToolEnvironment:
    """An episode whose environment is the recipe's tools: `reset` gives the prompt's
    messages, `step` runs the turn's tool calls and returns one `tool` message per call,
    or done when the turn calls none."""

    def __init__(self, tools: dict[str, Any]):
        self.tools = tools

    def reset(self, request: PromptRequest) -> list[dict[str, str]]:
        return list(request.messages)

    def step(self, message: str) -> StepResult:
        calls = parse_tool_calls(message)
        if not calls:
            return StepResult(done=True)
        return run_tool_calls(calls, self.tools, lambda name, args, _res: self.tools[name](args))


def run_tool_calls(
    calls: list[dict[str, Any] | ToolCallError],
    names: Collection[str],
    call_one: Callable[[str, Any, StepResult], tuple[str, bool]],
) -> StepResult:
    """A turn's tool calls in order, one `tool` message each: a call that does not parse
    or names no tool in `names` gets an error text (counted in `tool_errors`), the others
    `call_one(name, arguments, result)` -> (text, ok), which may add a reward to `result`
    or set its `done` (the calls after it are then not made, and no message is kept)."""
    res = StepResult()
    for call in calls:
        res.tool_calls += 1
        t0 = time.time()
        if isinstance(call, ToolCallError):
            text, ok = str(call), False
        elif call["name"] not in names:
            available = ", ".join(sorted(names))
            text, ok = f"error: unknown tool {call['name']!r}; available: {available}", False
        else:
            text, ok = call_one(call["name"], call["arguments"], res)
        res.tool_time_s += time.time() - t0
        res.tool_errors += not ok
        res.messages.append({"role": "tool", "content": text})
        if res.done:
            res.messages = []
            break
    return res


def make_tools(configs: list[PythonTool], tokenizer: Any) -> dict[str, Any]:
    """Tool name → runner for the recipe's `rollout.tools`."""
    return {c.name: PythonToolRunner(c, tokenizer) for c in configs}
