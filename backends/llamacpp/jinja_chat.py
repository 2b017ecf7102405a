"""A chat rendered by the model's own Jinja template on the in-process engine (as llama-server
`--jinja` renders it): the request's messages, tools, calls, tool results and thoughts as the
OpenAI-shaped values templates read (backends/chat/jinja_template.py), every client-written text
either as it is, where it holds no control token's text, or as a stand-in
(backends/chat/placeholders.py), so none of it can become a control token.

Message contents and thoughts always go in as stand-ins. Every other text of the client's (a
call's name, id and arguments, a tool result's call id and name, a tool's description and schema,
the strings of chat_template_kwargs) goes in as it is where it reads as text, so a template that
checks an id's length or compares a name still sees the client's words, and as a stand-in where
it holds a control token's text. A string the template writes through `tojson` is guarded there:
one holding stand-ins or a control token's text goes in as a stand-in of its JSON-escaped text.
(A text that reads as text alone could still complete a control token's text with the template's
own beside it only where a template writes part of one next to a client's text, which none of
the public templates in tests/fixtures does.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from backends.base import JobRejected
from backends.chat.jinja_template import ChatTemplate, TemplateError
from backends.chat.placeholders import StandIns
from backends.contract.schema import GenerateRequest, Message


class JinjaChat:
    def __init__(self, source: str, *, bos_token: str, eos_token: str, add_bos: bool, add_eos: bool,
                 reads_as_text: Callable[[str], bool]) -> None:
        self.source = source
        # a template writing bos_token first while the tokenizer adds BOS too: cut (llama.cpp's rule)
        self.template = ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, add_bos=add_bos,
                                     add_eos=add_eos)
        self._reads_as_text = reads_as_text  # no control token in the text (tokenized both ways)

    def render(self, request: GenerateRequest, stand_ins: StandIns | None) -> str:
        """The rendered chat; with `stand_ins`, the client's texts there as its stand-ins."""
        texts = _Texts(stand_ins, self._reads_as_text)
        objects = self.template.caps.requires_object_arguments
        messages = [_message(m, texts, objects) for m in request.messages or []]
        offered = request.tools if request.tools and request.tool_choice != "none" else None
        tools = [{"type": "function", "function": {"name": texts.plain(t.name),
                                                   "description": texts.plain(t.description or ""),
                                                   "parameters": texts.walk(t.parameters)}}
                 for t in offered or []]
        try:
            return self.template.render(messages, tools=tools or None, add_generation_prompt=True,
                                        extra=texts.walk(dict(request.chat_template_kwargs or {})),
                                        guard=texts.guard if stand_ins else None)
        except TemplateError as e:  # the template's own raise_exception, or a chat it cannot render
            raise JobRejected(f"the model's chat template refused this chat: {e}") from None


class _Texts:
    """The client's texts as one render gets them (as they are without stand-ins)."""

    def __init__(self, stand_ins: StandIns | None, reads_as_text: Callable[[str], bool]) -> None:
        self.stand_ins, self._reads_as_text = stand_ins, reads_as_text
        self._plain: dict[str, str] = {}  # one stand-in per text: a schema's key and its `required` agree

    def content(self, s: str) -> str:
        """A message's content or thought: a stand-in, but for none at all (which a template
        may test: a stand-in is never empty)."""
        return self.stand_ins.message(s) if self.stand_ins and s else s

    def plain(self, s: str) -> str:
        """Text a template may test, compare or print: as it is where it reads as text."""
        if self.stand_ins is None:
            return s
        if s not in self._plain:
            self._plain[s] = s if self._reads_as_text(s) else self.stand_ins.literal(s)
        return self._plain[s]

    def walk(self, value: Any) -> Any:
        """Every string of a JSON value through plain(), object keys too."""
        if isinstance(value, str):
            return self.plain(value)
        if isinstance(value, list):
            return [self.walk(v) for v in value]
        if isinstance(value, dict):
            return {self.plain(k): self.walk(v) for k, v in value.items()}
        return value

    def guard(self, s: str) -> str:
        """A string tojson writes: one holding stand-ins or a control token's text becomes a
        stand-in of its JSON-escaped text (the stand-ins' texts in their places)."""
        assert self.stand_ins is not None
        if not self.stand_ins.holds(s) and self._reads_as_text(s):
            return s
        return self.stand_ins.literal(json.dumps(self.stand_ins.expand(s), ensure_ascii=False)[1:-1])


def _message(m: Message, texts: _Texts, objects: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": texts.content(m.content)}
    if m.reasoning_content is not None:
        out["reasoning_content"] = texts.content(m.reasoning_content)
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": texts.plain(c.id), "type": "function",
             "function": {"name": texts.plain(c.name), "arguments": _arguments(c.arguments, texts, objects)}}
            for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = texts.plain(m.tool_call_id)
    if m.name is not None:
        out["name"] = texts.plain(m.name)
    return out


def _arguments(arguments: str, texts: _Texts, objects: bool) -> Any:
    """A call's arguments: JSON text, or for a template that reads them as an object (`objects`)
    the object, each of its strings through plain() (text that is not JSON goes as text: the
    renderer then refuses it)."""
    if objects:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict | list):
            return texts.walk(parsed)
    return texts.plain(arguments)
