"""OpenAI's tool-calling shapes <-> the fleet's (backends/contract/tool_specs.py), without HTTP:
`tools`, `tool_choice`, `parallel_tool_calls` and the history's assistant `tool_calls` and `tool`
messages in; a message's `tool_calls` and the streamed `tool_calls` deltas out.

Shared by chat completions (openai_bodies.py), batches and the Responses API, whose flat shapes
are turned into these first (responses_bodies.py). Imports nothing from Starlette.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backends.contract.tools import AnswerReader
from dispatcher.gateway.core import ApiError, unsupported

TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
CHOICES = ("auto", "none", "required")


def tool_fields(body: dict[str, Any], read_tool: Callable[[object, str], dict[str, Any]] | None = None,
                shape: str = '{"type": "function", "function": {...}}') -> dict[str, Any]:
    """The fleet's tool fields of an OpenAI body (an empty `tools` list counts as none);
    `read_tool`: one tool of this API's shape as the fleet's (chat's by default)."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise invalid("tools", f"'tools' must be a list of {shape}")
        out["tools"] = [(read_tool or _tool)(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if "tool_choice" in body:
        out["tool_choice"] = choice(body["tool_choice"], out.get("tools"))
    if "parallel_tool_calls" in body:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _tool(tool: object, where: str) -> dict[str, Any]:
    spec = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(spec, dict):
        raise invalid(where, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                      "(only function tools are supported)")
    for name in tool:
        if name not in ("type", "function"):
            raise unsupported(f"{where}.{name}", "OpenAI")
    return function(spec, f"{where}.function")


def function(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """A function's name, description and parameters (`strict` is what the fleet always does:
    the arguments are generated to match the schema)."""
    for name in spec:
        if name not in ("name", "description", "parameters", "strict"):
            raise unsupported(f"{where}.{name}", "OpenAI")
    out = {k: spec[k] for k in ("name", "description", "parameters") if spec.get(k) is not None}
    if not isinstance(out.get("name"), str):
        raise invalid(where, f"{where}.name is required: the function's name")
    return out


def choice(value: object, tools: list[dict[str, Any]] | None) -> object:
    """tool_choice as the fleet takes it: "auto", "none", "required" or {"name": ...}."""
    if value in CHOICES:
        return value
    named = None
    if isinstance(value, dict) and value.get("type") == "function":
        spec = value.get("function")
        named = spec.get("name") if isinstance(spec, dict) else value.get("name")  # Responses: flat
    if not isinstance(named, str):
        raise invalid("tool_choice", "tool_choice must be 'auto', 'none', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    offered = [t.get("name") for t in tools or []]
    if named not in offered:
        listed = ", ".join(str(n) for n in offered) or "none are given"
        raise invalid("tool_choice", f"tool_choice names the function '{named}', which is not among the "
                      f"tools ({listed})")
    return {"name": named}


def assistant_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (from the chat's history) as the fleet's."""
    if not isinstance(calls, list):
        raise invalid(where, f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        spec = call.get("function") if isinstance(call, dict) else None
        kind = call.get("type", "function") if isinstance(call, dict) else None
        if not isinstance(spec, dict) or not isinstance(call.get("id"), str) or kind != "function":
            raise invalid(at, f"{at} must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"arguments\": \"<JSON>\"}}")
        arguments = spec.get("arguments", "{}")
        if not isinstance(spec.get("name"), str) or not isinstance(arguments, str):
            raise invalid(at, f"{at}.function needs a name and arguments (a JSON string)")
        out.append({"id": call["id"], "name": spec["name"], "arguments": arguments})
    return out


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# -- results -> OpenAI --------------------------------------------------------------------------


def openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]


def message_fields(result: dict[str, Any] | None) -> dict[str, Any]:
    """A finished choice's `content` and `tool_calls` (for a tool answer: its words, or null and
    its calls)."""
    r = result or {}
    if "tool_calls" not in r:
        return {"content": r.get("text", "")}
    calls = r.get("tool_calls") or []
    thought = {"reasoning_content": r["reasoning_content"]} if r.get("reasoning_content") else {}
    return {"content": r.get("content"), **thought, **({"tool_calls": openai_calls(calls)} if calls else {})}


class ToolDeltas:
    """One streamed choice of an answer in JSON: the raw JSON deltas in, OpenAI's `delta` bodies
    out (thoughts as `reasoning_content`, as llama-server streams them; the answer's words as
    `content`; each call, once complete, as its `tool_calls` entries: the id, type and name first,
    then the arguments, as OpenAI streams them)."""

    def __init__(self, job_id: str) -> None:
        self.reader = AnswerReader(job_id)

    def deltas(self, raw: str) -> list[dict[str, Any]]:
        words, calls = self.reader.feed(raw)
        thought = self.reader.take_reasoning()
        out: list[dict[str, Any]] = [{"reasoning_content": thought}] if thought else []
        if words:
            out.append({"content": words})
        first = len(self.reader.calls) - len(calls)
        for i, call in enumerate(calls, start=first):
            out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                        "function": {"name": call["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": call["arguments"]}}]})
        return out
