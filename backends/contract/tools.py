"""Tool calling in the generic format: how a model is asked to call tools, and how its answer is
read back. Engines stay model-agnostic: they run an ordinary chat whose answer is constrained to
a JSON schema (tool_specs.answer_schema), so the built-in chat templates, which know only system,
user and assistant turns, serve tools too.

What the model sees (`render`): a system message listing each tool (name, description, the JSON
schema of its arguments) and how to answer, after the chat's own system text; earlier calls of
the chat as the JSON it would have written ({"tool_calls": [...]}), plain assistant answers as
{"response": "..."}, and tool results as user turns ("Tool result (name, id): ..."). Every piece
is message content, so an engine splices it in as text: a control token inside a tool's result
or description stays text and cannot open or close a turn.

What comes back (`AnswerReader`): the raw text is the JSON answer (the job's stream carries it
as generated); the reader turns it, as it grows, into the answer's words (the `response` string,
decoded) and its calls, each with an id derived from the job id and its index; a call repeated
word for word in one answer is read once. A job run in its model's own syntax streams the same
object, written by the worker (backends/chat/answer_json.py) with its thoughts under `reasoning`
and its keys in the order the answer went, repeated where it went back to one.

Importable without llama_cpp.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.contract.schema import GenerateRequest, Message
from backends.contract.tool_specs import NamedTool, Tool, ToolChoice, answer_schema, max_calls, words_schema

# an answer's first key and its value's opening; each next key; the object's end
_KEY = r'"(?P<key>tool_calls|response|reasoning)"\s*:\s*(?P<open>\[|"|\{)'
_HEAD = re.compile(r"\s*\{\s*" + _KEY)
_NEXT = re.compile(r"\s*,\s*" + _KEY)
_CLOSE = re.compile(r"\s*\}")
_OPENINGS = {"tool_calls": "[", "response": '"{[', "reasoning": '"'}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def calls_tools(request: GenerateRequest) -> bool:
    """Whether the answer is constrained to the generic format (tools offered, not 'none')."""
    return bool(request.tools) and request.tool_choice != "none"


def answers_in_json(request: GenerateRequest) -> bool:
    """Whether the job's stream carries the answer JSON (its words, calls and thoughts apart), not
    plain text: tools offered, or thoughts asked for apart. Producers read the stream by it."""
    return calls_tools(request) or request.reasoning_format not in (None, "none")


def touches_tools(request: GenerateRequest) -> bool:
    """Whether tools are offered, or the chat holds calls or their results."""
    return bool(request.tools) or any(m.role == "tool" or m.tool_calls for m in request.messages or [])


def lower(request: GenerateRequest) -> tuple[GenerateRequest, bool]:
    """The request an engine runs: roles system/user/assistant only, the tools in the system
    message and the answer's schema as `format` (unchanged for a chat without tools); and whether
    its answer is in the generic format."""
    if not touches_tools(request):
        if not answers_in_json(request):
            return request, False
        # thoughts asked apart of an engine that does not read its model's: the words as answer JSON
        words = {"format": words_schema(request.format), "reasoning_format": None}
        return request.model_copy(update=words), True
    messages, schema = render(request)
    update: dict[str, Any] = {"messages": messages, "tools": None, "tool_choice": None,
                              "parallel_tool_calls": None}
    if schema is not None:
        update["format"] = schema
        update["end_at_repeated_call"] = max_calls(request.tool_choice, request.parallel_tool_calls) > 1
    return request.model_copy(update=update), schema is not None


def render(request: GenerateRequest) -> tuple[list[Message], dict[str, Any] | None]:
    """The chat as plain system/user/assistant messages (module docstring), and the JSON schema
    its answer must match (None: a plain answer, tool_choice 'none' or no tools)."""
    active = calls_tools(request)
    names = {c.id: c.name for m in request.messages or [] for c in m.tool_calls or []}
    out: list[Message] = []
    results: list[str] = []  # consecutive tool results: one user turn
    for m in request.messages or []:
        if m.role == "tool":
            who = ", ".join(x for x in (m.name or names.get(m.tool_call_id or ""), m.tool_call_id) if x)
            results.append(f"Tool result ({who}):\n{m.content}" if who else f"Tool result:\n{m.content}")
            continue
        if results:
            out.append(Message(role="user", content="\n\n".join(results)))
            results = []
        if m.role == "assistant" and m.tool_calls and active:
            calls = [{"name": c.name, "arguments": _arguments(c.arguments)} for c in m.tool_calls]
            out.append(Message(role="assistant", content=json.dumps({"tool_calls": calls})))
        elif m.role == "assistant" and m.tool_calls:  # no JSON answer wanted now: no JSON to imitate
            said = "\n".join(f"(I called {c.name} with {c.arguments}.)" for c in m.tool_calls)
            out.append(Message(role="assistant", content=f"{m.content}\n{said}".strip()))
        elif m.role == "assistant" and active:
            out.append(Message(role="assistant", content=json.dumps({"response": m.content})))
        else:
            out.append(Message(role=m.role, content=m.content))
    if results:
        out.append(Message(role="user", content="\n\n".join(results)))
    if not active:
        return out, None
    assert request.tools is not None
    guide = instructions(request.tools, request.tool_choice, request.parallel_tool_calls, request.format)
    if out and out[0].role == "system":
        out[0] = Message(role="system", content=f"{out[0].content}\n\n{guide}")
    else:
        out.insert(0, Message(role="system", content=guide))
    return out, answer_schema(request.tools, request.tool_choice, request.parallel_tool_calls, request.format)


def instructions(tools: list[Tool], choice: ToolChoice | None, parallel: bool | None,
                 response: Literal["json"] | dict[str, Any] | None = None) -> str:
    """The system text that offers the tools and says how to answer (`response`: the format of
    an answer that calls no tool)."""
    named = choice.name if isinstance(choice, NamedTool) else None
    listed = []
    for t in tools:
        if named is None or t.name == named:
            about = f": {t.description}" if t.description else ""
            listed.append(f"- {t.name}{about}\n  arguments (JSON schema): {json.dumps(t.parameters)}")
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}'
    how = "one call" if max_calls(choice, parallel) == 1 else "one or more calls, each different"
    text = "You can call these tools:\n" + "\n".join(listed) + "\n\n"
    if named is not None:
        return text + f'Answer by calling {named}, with one JSON object: {call.replace("<tool name>", named)}'
    if choice == "required":
        return text + f"Answer by calling tools ({how}), with one JSON object: {call}"
    answer = '{"response": "<your answer>"}'
    if response is not None:
        shape = "" if response == "json" else f" matching this JSON schema: {json.dumps(response)}"
        answer = f'{{"response": <your answer as one JSON object{shape}>}}'
    return (text + "Answer with one JSON object, either\n"
            f"{call} to call tools ({how}; their results come back in the next message), or\n"
            f"{answer} to answer the user. Call a tool only for what the chat "
            "does not tell yet; once the tool results you need are there, answer.")


def _arguments(text: str) -> Any:
    """A past call's arguments as the JSON they were (text that is not JSON stays text)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_id(job_id: str, index: int) -> str:
    """The id of a job's index-th call: the same in its stream and its result, on any gateway."""
    return "call_" + hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()[:24]


# -- reading the answer --------------------------------------------------------------------------


@dataclass
class AnswerReader:
    """Reads an answer JSON as it grows: `feed` each delta of raw text, get the words decoded
    since the last feed and the calls completed since; `take_reasoning` gives the thoughts read
    since it was last called. The text is one object: the generic format's single key
    (`response` or `tool_calls`), or a native-syntax job's keys in the order its answer went,
    `reasoning` among them, a key repeated when the answer went back to it
    (backends/chat/answer_json.py). A grammar or the worker's writer made it valid JSON, so the
    reader only follows it; a text cut short (max_tokens) yields what was complete."""

    job_id: str
    raw: str = ""
    kind: str | None = None  # the value being read (or last read): "response", "structured" (a
    # response_format answer), "tool_calls" or "reasoning"; None before the first
    content: str = ""  # the words so far
    reasoning: str = ""  # the thoughts so far
    calls: list[dict[str, str]] = field(default_factory=list)  # {id, name, arguments (JSON text)}
    repeated: bool = False  # a call repeated an earlier one (and was dropped)
    _seen: set[str] = field(default_factory=set)  # each call's name and arguments, keys sorted
    _thought: list[str] = field(default_factory=list)  # thoughts not yet taken
    _at: int = 0  # next character of raw to read
    _depth: int = 0  # calls: nesting inside the array
    _in_string: bool = False
    _escaped: bool = False
    _item_start: int = -1
    _in_value: bool = False  # reading a value (else between keys)
    _ended: bool = False

    def feed(self, delta: str) -> tuple[str, list[dict[str, str]]]:
        self.raw += delta
        words: list[str] = []
        done = len(self.calls)
        while not self._ended:
            if not self._in_value and not self._next_key():
                break
            closed = self._read(words)
            if not closed:
                break
            self._in_value = False
        return "".join(words), self.calls[done:]

    def take_reasoning(self) -> str:
        """The thoughts read since the last call."""
        text = "".join(self._thought)
        self._thought = []
        return text

    def _next_key(self) -> bool:
        """Past the next key to its value's first character (True), or the object's end."""
        head = (_NEXT if self.kind is not None else _HEAD).match(self.raw, self._at)
        if head is None:
            if self.kind is not None and _CLOSE.match(self.raw, self._at):
                self._ended = True
            return False
        key, opening = head.group("key"), head.group("open")
        if opening not in _OPENINGS[key]:  # no writer of the format wrote this: stop reading
            self._ended = True
            return False
        self.kind, self._at, self._in_value = key, head.end(), True
        if key == "response" and opening != '"':  # the answer's response_format
            self.kind, self._at = "structured", head.start("open")
        return True

    def _read(self, words: list[str]) -> bool:
        """Read the current value on; True once it closed."""
        if self.kind in ("response", "reasoning"):
            text, closed = self._read_string()
            if self.kind == "response":
                self.content += text
                words.append(text)
            else:
                self.reasoning += text
                self._thought.append(text)
            return closed
        if self.kind == "structured":
            text, closed = self._read_value()
            self.content += text
            words.append(text)
            return closed
        return self._read_calls()

    def _read_string(self) -> tuple[str, bool]:
        out = []
        raw, i = self.raw, self._at
        closed = False
        while i < len(raw):
            c = raw[i]
            if c == '"':
                closed = True
                i += 1
                break
            if c != "\\":
                out.append(c)
                i += 1
                continue
            if i + 1 >= len(raw):
                break  # the escape's rest has not come yet
            if raw[i + 1] != "u":
                out.append(_ESCAPES.get(raw[i + 1], raw[i + 1]))
                i += 2
                continue
            char, used = _unicode_escape(raw, i)
            if used == 0:
                break
            out.append(char)
            i += used
        self._at = i
        return "".join(out), closed

    def _read_value(self) -> tuple[str, bool]:
        """The structured answer's JSON text as it grows, up to the end of its object."""
        raw, start = self.raw, self._at
        i = start
        closed = False
        while i < len(raw) and not closed:
            step = self._track(raw[i])
            self._depth += step
            closed = step < 0 and self._depth == 0
            i += 1
        self._at = i
        return raw[start:i], closed

    def _read_calls(self) -> bool:
        raw, i = self.raw, self._at
        closed = False
        while i < len(raw) and not closed:
            step = self._track(raw[i])
            if step > 0:
                if self._depth == 0:
                    self._item_start = i
                self._depth += 1
            elif step < 0:
                if self._depth == 0:  # the array's own end
                    closed = True
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        self._add_call(raw[self._item_start:i + 1])
            i += 1
        self._at = i
        return closed

    def _track(self, c: str) -> int:
        """Follow one character of JSON text (strings and their escapes): 1 where a container
        opens outside a string, -1 where one closes, else 0."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
            return 0
        if c == '"':
            self._in_string = True
            return 0
        return 1 if c in "{[" else -1 if c in "}]" else 0

    def _add_call(self, text: str) -> None:
        try:
            item = json.loads(text, strict=False)  # the grammar lets raw control characters into strings
        except ValueError:  # only a backend that ignored the grammar writes this: not a call
            return
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "arguments" not in item:
            return
        # a call the answer already holds, word for word (keys in any order), is dropped: small
        # models repeat a call, and running it twice would do the same thing twice. Ids count
        # the calls kept, so the stream and the result agree.
        same = call_key(item["name"], item["arguments"])
        if same in self._seen:
            self.repeated = True
            return
        self._seen.add(same)
        self.calls.append({"id": call_id(self.job_id, len(self.calls)), "name": item["name"],
                           "arguments": arguments_text(item["arguments"])})


def call_key(name: str, arguments: Any) -> str:
    """What makes two calls the same: name and arguments, the arguments' keys in any order."""
    return json.dumps([name, arguments], sort_keys=True)


def arguments_text(arguments: Any) -> str:
    """A call's arguments as the JSON text a result carries."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape in a string: keep it escaped
        text = json.dumps(arguments)
    return text


def _unicode_escape(raw: str, i: int) -> tuple[str, int]:
    """The character of the \\uXXXX escape at raw[i] (a surrogate pair: both escapes) and the
    characters it used; (.., 0) while it is incomplete. A lone surrogate becomes U+FFFD: no
    JSON encoder could write it back."""
    if i + 6 > len(raw):
        return "", 0
    code = int(raw[i + 2:i + 6], 16)
    if 0xD800 <= code < 0xDC00:
        if i + 12 > len(raw) and raw[i + 6:i + 8] in ("\\u", "\\", ""):
            return "", 0
        if raw[i + 6:i + 8] == "\\u":
            low = int(raw[i + 8:i + 12], 16)
            if 0xDC00 <= low < 0xE000:
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return "\ufffd", 6
    if 0xDC00 <= code < 0xE000:
        return "\ufffd", 6
    return chr(code), 6


@dataclass(frozen=True)
class Answer:
    content: str | None  # the words; None when the answer called tools and said nothing
    tool_calls: list[dict[str, str]]
    reasoning: str = ""  # the thoughts, where the answer carried them apart


def read_answer(text: str, job_id: str) -> Answer:
    """A whole answer JSON: its words, its calls, its thoughts."""
    reader = AnswerReader(job_id)
    reader.feed(text)
    if reader.calls:
        return Answer(reader.content or None, reader.calls, reader.reasoning)
    if reader.kind is None and text.strip() and not text.lstrip().startswith("{"):
        return Answer(text, [])  # a backend that ignored the grammar answered in words
    return Answer(reader.content, [], reader.reasoning)
