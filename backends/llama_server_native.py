"""What a llama-server speaks, and a chat sent to it in its model's own dialect.

A llama-server with Jinja on (`--jinja`, llama.cpp's default since late 2025) renders a chat's
tools, past calls and tool results with its model's own template, constrains a call to the
template's syntax with its own grammar and streams what it parsed back: `delta.tool_calls`,
`delta.reasoning_content`, `delta.content`. When its template renders tools too (a template
written for them, e.g. `--chat-template-file` with Qwen 2.5's), the backend sends a chat with
tools as it came (`speaks`) and re-writes those deltas as the answer JSON
(backends/chat/openai_deltas.py), as the in-process engine does for its model's own syntax;
otherwise, or with `tool_format: generic`, the worker lowers the chat to the generic tool format
first (backends/contract/tools.py), as before.

Whether Jinja is on is not in /props (`chat_template_caps` reads the template, whatever renders
it): the backend asks /apply-template to render a chat offering one tool. Without Jinja the server
refuses the tools ("tools param requires --jinja flag"); with a template that ignores tools (the
ChatML fallback of a GGUF without a template) the tool's name is not in the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backends.contract import tools
from backends.contract.schema import GenerateRequest, Message
from backends.contract.tool_specs import NamedTool, max_calls

PROBE_TOOL = "fleet_probe_tool"
PROBE_CHAT: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": {"name": PROBE_TOOL, "description": "a probe",
                                                "parameters": {"type": "object", "properties": {}}}}],
}


@dataclass(frozen=True)
class ServerDialect:
    jinja: bool = False  # the server renders chats with Jinja: it takes tools, reasoning_format
    tools: bool = False  # and its template renders tools and calls, which the server parses back

    @classmethod
    def read(cls, props: dict[str, Any], status: int, rendered: Any) -> ServerDialect:
        """From /props and the server's answer to PROBE_CHAT at /apply-template."""
        if status != 200 or not isinstance(rendered, dict):
            return cls()
        caps = props.get("chat_template_caps")
        # a server old enough to have no caps says nothing against it: the render decides
        parses_calls = not isinstance(caps, dict) or caps.get("supports_tool_calls", True) is True
        return cls(jinja=True, tools=parses_calls and PROBE_TOOL in str(rendered.get("prompt", "")))

    def speaks(self, request: GenerateRequest, tool_format: str) -> bool:
        """Whether a chat goes to the server as sent (else the worker lowers it). A chat without
        tools does wherever Jinja renders it (its thoughts apart, as the server reads them); one
        with tools where the template renders them and `tool_format` is native. Structured output
        beside tools keeps the generic format (the server refuses a grammar beside tools)."""
        if request.messages is None or not self.jinja:
            return False
        return not tools.touches_tools(request) or (
            self.tools and tool_format == "native" and request.format is None)


def openai_message(m: Message) -> dict[str, Any]:
    """A message as OpenAI's API (and llama-server) has it: a call is a function's name and its
    arguments' JSON text."""
    out = m.model_dump(exclude_none=True, exclude={"tool_calls"})
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
    return out


def tool_fields(request: GenerateRequest) -> dict[str, Any]:
    """The request's tools in llama-server's terms. It takes tool_choice auto, none or required
    only (a named function reads as auto there): a named one goes as that function alone,
    required, one call. Tools not to be called are not offered at all, as the in-process engine
    renders them."""
    if not tools.calls_tools(request) or request.tools is None:
        return {}
    choice = request.tool_choice or "auto"
    offered = request.tools
    if isinstance(choice, NamedTool):
        offered = [t for t in request.tools if t.name == choice.name]
        choice = "required"
    return {
        "tools": [{"type": "function", "function": t.model_dump(exclude_none=True)} for t in offered],
        "tool_choice": choice,
        "parallel_tool_calls": max_calls(request.tool_choice, request.parallel_tool_calls) > 1,
        # each chunk carries its timings: an answer cut at its last call still counts its tokens
        "timings_per_token": True,
    }


def rendered_texts(request: GenerateRequest) -> list[str]:
    """Every text of the client's the server's template would render: messages, thoughts, past
    calls' names, ids and arguments, tool results' ids and names, the tools' descriptions and
    schemas, chat_template_kwargs' strings. The server tokenizes the rendered chat with control
    tokens parsed, so none of these may hold a control token's text."""
    texts: list[str] = []
    for m in request.messages or []:
        texts += [m.content, m.reasoning_content or "", m.tool_call_id or "", m.name or "",
                  *(x for c in m.tool_calls or [] for x in (c.id, c.name, c.arguments))]
    for t in request.tools or [] if tools.calls_tools(request) else []:
        texts += [t.description or "", json.dumps(t.parameters, ensure_ascii=False)]
    texts += [v for v in (request.chat_template_kwargs or {}).values() if isinstance(v, str)]
    return [t for t in texts if t]


def answer_calls(request: GenerateRequest) -> int:
    """How many calls the answer may hold (0: no call is read)."""
    return max_calls(request.tool_choice, request.parallel_tool_calls) if tools.calls_tools(request) else 0
