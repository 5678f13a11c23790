"""MCP tools of an OpenEnv environment (`rollout.environment: {type: openenv, mcp_tools:
true}`), through OpenEnv's step API (its "simulation mode", the one with rewards):

- at reset, the action `{"type": "list_tools"}` → observation `{"tools": [{"name",
  "description", "input_schema"}]}` (openenv-core's `ListToolsObservation`);
- each tool call the model writes (`<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, parsed as for `rollout.tools`) is the action `{"type": "call_tool",
  "tool_name", "arguments"}` → observation `{"tool_name", "result", "error"}`
  (`CallToolObservation`) with the step's `reward` and `done`.

The tools are shown to the model as text in the system message (`tools_prompt`); each
result comes back as a `tool` message (`result_text`). A malformed call, an unknown
tool, or a call the server answers with an `error` gives the model an error text and
counts in `tool_errors`; the episode goes on. A listing of the wrong shape or with no
tools, or a result that is not text (an image, audio), fails the episode
(`EnvironmentFailed`), as does anything the transport refuses (openenv.py).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from .remote import EnvironmentFailed


class McpTool(BaseModel):
    """One listed tool (openenv-core's `Tool`; `inputSchema`, MCP's own spelling, too)."""

    name: str = Field(min_length=1)
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=dict, alias="inputSchema")

    model_config = {"populate_by_name": True}


def parse_tools(observation: dict[str, Any], source: str) -> dict[str, McpTool]:
    """Tool name → tool of a `list_tools` observation.

    Raises:
        EnvironmentFailed: no `tools` list, a tool of the wrong shape, or no tool at all.
    """
    raw = observation.get("tools")
    if not isinstance(raw, list):
        raise EnvironmentFailed(
            f"{source}: list_tools answered {observation!r:.200} without a tools list "
            f"(is it an MCP environment? else drop rollout.environment.mcp_tools)"
        )
    try:
        tools = [McpTool.model_validate(t) for t in raw]
    except ValidationError as e:
        raise EnvironmentFailed(f"{source}: list_tools: a tool of the wrong shape: {e}") from e
    if not tools:
        raise EnvironmentFailed(
            f"{source}: list_tools listed no tools; drop rollout.environment.mcp_tools "
            f"or give the environment tools"
        )
    return {t.name: t for t in tools}


def tools_prompt(tools: dict[str, McpTool]) -> str:
    """The tools as text for the system message: how to call, then one line per tool
    (name, description, JSON Schema of its arguments)."""
    lines = [
        "You can call these tools. To call one, write",
        '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>',
        "and its result comes back. Tools:",
    ]
    for t in tools.values():
        schema = json.dumps(t.input_schema, sort_keys=True)
        lines.append(f"- {t.name}: {t.description} Arguments (JSON Schema): {schema}")
    return "\n".join(lines)


def with_tools(messages: list[dict[str, str]], tools: dict[str, McpTool]) -> list[dict[str, str]]:
    """`messages` with the tools' text appended to the first system message (or a
    system message of it put first)."""
    text = tools_prompt(tools)
    out = [dict(m) for m in messages]
    for m in out:
        if m["role"] == "system":
            m["content"] = f"{m['content']}\n\n{text}"
            return out
    return [{"role": "system", "content": text}, *out]


def result_text(observation: dict[str, Any], source: str) -> tuple[str, bool]:
    """(text for the model, ok) of a `call_tool` observation: the server's `error` as
    an error text (not ok); else the result's text content (MCP `content` items of type
    `text`, joined by newlines), its `data`, or the result itself as JSON.

    Raises:
        EnvironmentFailed: a result whose content is not text.
    """
    error = observation.get("error")
    if error:
        kind = error.get("error_type", "error") if isinstance(error, dict) else "error"
        message = error.get("message", error) if isinstance(error, dict) else error
        return f"error ({kind}): {message}", False
    result = observation.get("result")
    if isinstance(result, str):
        return result, True
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        kinds = {c.get("type") if isinstance(c, dict) else type(c) for c in result["content"]}
        if kinds - {"text"}:
            raise EnvironmentFailed(
                f"{source}: tool {observation.get('tool_name')!r} returned content of "
                f"kind {sorted(map(str, kinds - {'text'}))}; only text results are supported"
            )
        text = "\n".join(str(c.get("text", "")) for c in result["content"])
        ok = not (result.get("is_error") or result.get("isError"))
        return text, ok
    if isinstance(result, dict) and "data" in result:
        result = result["data"]
    return json.dumps(result, sort_keys=True), True
