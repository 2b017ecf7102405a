"""The answer JSON a native-syntax job streams: what the worker read from its model's own text
(thoughts, words, calls) re-written in the one format the gateway reads
(backends/contract/tools.AnswerReader), so producers keep one parser whatever the model.

The wire is one JSON object whose keys come in the order the answer went:

    {"reasoning": "...", "response": "...", "tool_calls": [{"name": ..., "arguments": {...}}, ...]}

A key appears again when the answer goes back to it: thoughts, then words, then a call, then
more words is `{"reasoning": "..", "response": "..", "tool_calls": [..], "response": ".."}`.
Repeated keys are valid JSON text, and the reader reads the object in order, so nothing is lost
and nothing waits: each string grows as its text arrives (the writer never goes back into
written text), each call goes out whole. A generic-format answer is the same object with one
key, so the reader needs no other mode. `json.loads` of the whole would keep only each key's
last value: read the text with the reader.

`JsonScan` follows a JSON value's text as it arrives, for the parsers that must find where a
call's arguments end; `CallLedger` keeps the calls an answer made, for every reader of a model's
calls (its own syntax, or a server's parsed deltas). Importable without llama_cpp.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from backends.contract.tools import arguments_text, call_id, call_key

KEYS = {"reasoning": "reasoning", "content": "response", "call": "tool_calls"}


@dataclass
class Piece:
    """What one delta of a model's text added, in order: `parts` is a list of ("reasoning", text),
    ("content", text) and ("call", {"id", "name", "arguments"}) (arguments: JSON text)."""

    parts: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def reasoning(self) -> str:
        return "".join(v for k, v in self.parts if k == "reasoning")

    @property
    def content(self) -> str:
        return "".join(v for k, v in self.parts if k == "content")

    @property
    def calls(self) -> list[dict[str, str]]:
        return [v for k, v in self.parts if k == "call"]

    def add(self, kind: str, value: Any) -> None:
        """Append a part; text joins the part before when it is of the same kind."""
        if kind != "call":
            if not value:
                return
            if self.parts and self.parts[-1][0] == kind:
                self.parts[-1] = (kind, self.parts[-1][1] + value)
                return
        self.parts.append((kind, value))

    def extend(self, other: Piece) -> None:
        for kind, value in other.parts:
            self.add(kind, value)


class CallLedger:
    """The calls of one answer as they are read: each gets its id from the job id and how many
    calls were kept before it (so the stream and the result agree); a call repeating an earlier
    one word for word is dropped and marks the answer `repeated` (small models loop on a call)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.calls: list[dict[str, str]] = []
        self.repeated = False
        self._seen: set[str] = set()

    def add(self, out: Piece, name: str, arguments: Any) -> None:
        """Keep a call (`arguments`: parsed JSON, or JSON text some models were taught to write)
        and add it to `out`, unless it repeats one."""
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        key = call_key(name, arguments)
        if key in self._seen:
            self.repeated = True
            return
        self._seen.add(key)
        call = {"id": call_id(self.job_id, len(self.calls)), "name": name,
                "arguments": arguments_text(arguments)}
        self.calls.append(call)
        out.add("call", call)


class AnswerJsonWriter:
    """Pieces in, the answer JSON's text out, as it grows (module docstring)."""

    def __init__(self) -> None:
        self._open: str | None = None  # the key whose value is being written: its string or array
        self._begun = False

    def feed(self, piece: Piece) -> str:
        out: list[str] = []
        for kind, value in piece.parts:
            key = KEYS[kind]
            if kind != "call" and not value:
                continue
            if self._open != key:
                out.append(self._switch(key))
            elif kind == "call":
                out.append(", ")
            if kind == "call":
                out.append(f'{{"name": {json.dumps(value["name"], ensure_ascii=False)}, '
                           f'"arguments": {value["arguments"]}}}')
            else:
                out.append(json.dumps(value, ensure_ascii=False)[1:-1])
        return "".join(out)

    def close(self) -> str:
        """The object's end. An answer that said nothing is an empty response, as the generic
        format writes one."""
        if not self._begun:
            self._begun = True
            return '{"response": ""}'
        end = self._end()
        self._open = None
        return end + "}"

    def _switch(self, key: str) -> str:
        opening = '"' if key != "tool_calls" else "["
        if not self._begun:
            self._begun, self._open = True, key
            return f'{{"{key}": {opening}'
        text = f'{self._end()}, "{key}": {opening}'
        self._open = key
        return text

    def _end(self) -> str:
        if self._open is None:
            return ""
        return "]" if self._open == "tool_calls" else '"'


class JsonScan:
    """Follows one JSON object or array as its text arrives, to where it closes (`done`): the
    parsers find where a call's arguments end without parsing them until they have. ValueError
    where the value starts with something else."""

    _OUT = re.compile(r'["{}\[\]]')
    _IN = re.compile(r'["\\]')

    def __init__(self) -> None:
        self.depth = 0
        self.started = self.in_string = self.escaped = self.done = False

    def scan(self, text: str) -> int:
        """How many characters of `text` belong to the value (all, until it closes)."""
        i, n = 0, len(text)
        if not self.started:
            while i < n and text[i] in " \t\r\n":
                i += 1
            if i == n:
                return n
            if text[i] not in "{[":
                raise ValueError("not a JSON object or array")
            self.started = True
        while i < n:
            if self.escaped:
                self.escaped, i = False, i + 1
                continue
            found = (self._IN if self.in_string else self._OUT).search(text, i)
            if found is None:
                return n
            c, i = found.group(), found.end()
            if self.in_string:  # a backslash escapes the next character; a quote ends the string
                self.escaped = c == "\\"
                self.in_string = self.escaped
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i
        return n
