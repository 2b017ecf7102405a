"""The tools a request offers the model and the calls a model answers with: their shapes, their
bounds, and the JSON schema an answer must match in the generic tool format
(backends/contract/tools.py renders the prompt and reads the answer).

The answer schema is what makes a call well-formed whatever the model: generation is constrained
to it by the structured-output grammar, so the text is always one JSON object that is either
{"tool_calls": [{"name": <an offered tool>, "arguments": <that tool's parameters>}, ...]} or,
when the model may also answer in words (`tool_choice: auto`), {"response": "<text>"}.

Importable without llama_cpp; imports nothing else of the project's (schema.py imports it).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 64
MAX_TOOLS_CHARS = 65_536  # every tool of a request serialized: names, descriptions, parameters
MAX_DESCRIPTION_CHARS = 4096
MAX_ARGUMENTS_CHARS = 100_000  # one call's arguments (JSON text) in a chat's history
MAX_CALLS_PER_MESSAGE = 64
MAX_PARALLEL_CALLS = 16  # calls in one answer unless parallel_tool_calls is false or one is named
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's names, and the dots some clients use
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class Tool(BaseModel):
    """A function the model may call; `parameters` is the JSON schema of its arguments."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(NO_PARAMETERS))


class ToolCall(BaseModel):
    """One call, as a result carries it and an assistant message of a chat's history repeats it:
    `arguments` is JSON text (an object), as OpenAI's API has it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)


class NamedTool(BaseModel):
    """`tool_choice` naming the one tool the model must call."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=TOOL_NAME)


ToolChoice = Literal["auto", "none", "required"] | NamedTool


def check_tools(tools: list[Tool], choice: ToolChoice | None) -> None:
    """ValueError naming the problem: duplicate names, too much text, a choice naming a tool
    that is not offered."""
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools: each tool needs its own name; {', '.join(twice)} appears more than once")
    size = tools_chars(tools)
    if size > MAX_TOOLS_CHARS:
        raise ValueError(f"tools: {size:,} characters together; the limit is {MAX_TOOLS_CHARS:,}")
    if isinstance(choice, NamedTool) and choice.name not in names:
        raise ValueError(f"tool_choice names the function '{choice.name}', which is not among the tools "
                         f"({', '.join(names)})")


def tools_chars(tools: list[Tool]) -> int:
    """The tools' text as a prompt carries it: every tool serialized (names, descriptions,
    parameters)."""
    return len(json.dumps([t.model_dump(exclude_none=True) for t in tools]))


def max_calls(choice: ToolChoice | None, parallel: bool | None) -> int:
    """How many calls one answer may hold: OpenAI's rules. A named function is called exactly
    once; else up to MAX_PARALLEL_CALLS unless `parallel` is False (unset means true, OpenAI's
    default). Small models tend to repeat a call: an answer ends at a call that repeats an
    earlier one word for word, and the repeat is dropped (tools.AnswerReader)."""
    return 1 if parallel is False or isinstance(choice, NamedTool) else MAX_PARALLEL_CALLS


def answer_schema(tools: list[Tool], choice: ToolChoice | None, parallel: bool | None,
                  response: Literal["json"] | dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON schema of the answer (module docstring) for tool_choice auto (None), required or
    a named tool, with at most `max_calls` calls; `response`: the request's structured-output
    format, which an answer that calls no tool follows (`{"response": <that JSON>}`, as OpenAI
    applies response_format to the final answer of a chat with tools). Each tool's
    parameters sit under `$defs` (their own local `$ref`s rebased there), so pydantic-style
    schemas with `$defs` keep working."""
    offered = [t for t in tools if not isinstance(choice, NamedTool) or t.name == choice.name]
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(offered):
        key = f"tool_{i}"
        defs[key] = _rebased(tool.parameters, f"#/$defs/{key}")
        items.append({"type": "object", "properties": {"name": {"const": tool.name},
                                                       "arguments": {"$ref": f"#/$defs/{key}"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    listed = {"type": "array", "items": items[0] if len(items) == 1 else {"oneOf": items}, "minItems": 1,
              "maxItems": max_calls(choice, parallel)}
    calls = {"type": "object", "properties": {"tool_calls": listed}, "required": ["tool_calls"],
             "additionalProperties": False}
    if choice in (None, "auto"):
        return {"$defs": defs, "oneOf": [calls, _words(response, defs)]}
    return {"$defs": defs, **calls}


def words_schema(response: Literal["json"] | dict[str, Any] | None) -> dict[str, Any]:
    """The schema of an answer in words only (`{"response": ...}`)."""
    defs: dict[str, Any] = {}
    words = _words(response, defs)
    return {"$defs": defs, **words} if defs else words


def _words(response: Literal["json"] | dict[str, Any] | None, defs: dict[str, Any]) -> dict[str, Any]:
    said: dict[str, Any] = {"type": "string"}
    if response == "json":
        said = {"type": "object"}
    elif isinstance(response, dict):
        defs["answer"] = _rebased(response, "#/$defs/answer")
        said = {"$ref": "#/$defs/answer"}
    return {"type": "object", "properties": {"response": said}, "required": ["response"],
            "additionalProperties": False}


def _rebased(schema: dict[str, Any], base: str) -> dict[str, Any]:
    """`schema` moved to `base`: its local references ("#", "#/$defs/X") point into its new place;
    `$schema`/`$id` go (the answer schema is one document)."""
    moved = {k: v for k, v in copy.deepcopy(schema).items() if k not in ("$schema", "$id")}
    todo: list[Any] = [moved]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = base + ref[1:]
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return moved
