"""A chat rendered by the model's own Jinja template on the in-process engine (as llama-server
`--jinja` renders it): the request's messages, tools, calls, tool results and thoughts as the
OpenAI-shaped values templates read (backends/chat/jinja_template.py), every client-written text
as a stand-in (backends/chat/placeholders.py), so none of it can become a control token.

Texts a template writes through `tojson` (a tool's description, a call's arguments once parsed)
are guarded there: one whose text holds a control token's goes in as a literal stand-in. A call's
arguments a template writes as the string it is get the same treatment before rendering: strings
holding a control token's text are re-encoded with the token's marks escaped as JSON allows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from backends.base import JobRejected
from backends.chat.jinja_template import ChatTemplate, TemplateError
from backends.chat.placeholders import literal_stand_in, message_stand_in
from backends.contract.schema import GenerateRequest, Message

# characters that open or close control tokens' texts ("<|im_start|>", "[INST]", DeepSeek's fullwidth bar),
# held by a private-use mark through json.dumps, then written as JSON's \uXXXX escape
_MARKS = {c: f"\ue002{ord(c):04x}" for c in "<>[]|\uff5c"}
_MARKED = re.compile("\ue002([0-9a-f]{4})")


class JinjaChat:
    def __init__(self, source: str, *, bos_token: str, eos_token: str, add_bos: bool, add_eos: bool,
                 reads_as_text: Callable[[str], bool]) -> None:
        self.source = source
        # a template writing bos_token first while the tokenizer adds BOS too: cut (llama.cpp's rule)
        self.template = ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, add_bos=add_bos,
                                     add_eos=add_eos)
        self._reads_as_text = reads_as_text  # no control token in the text (tokenized both ways)

    def render(self, request: GenerateRequest, stand_ins: bool) -> tuple[str, list[str]]:
        """The rendered chat and, with `stand_ins`, the texts its stand-ins take the place of."""
        texts: list[str] = []

        def text(s: str) -> str:
            if not stand_ins:
                return s
            texts.append(s)
            return message_stand_in(len(texts) - 1)

        def guard(s: str) -> str:
            if not stand_ins or self._reads_as_text(s):
                return s
            texts.append(json.dumps(s, ensure_ascii=False)[1:-1])
            return literal_stand_in(len(texts) - 1)

        messages = [self._message(m, text, stand_ins) for m in request.messages or []]
        offered = request.tools if request.tools and request.tool_choice != "none" else None
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.parameters}} for t in offered or []]
        try:
            rendered = self.template.render(messages, tools=tools or None, add_generation_prompt=True,
                                            extra=dict(request.chat_template_kwargs or {}), guard=guard)
        except TemplateError as e:  # the template's own raise_exception, or a chat it cannot render
            raise JobRejected(f"the model's chat template refused this chat: {e}") from None
        return rendered, texts

    def _message(self, m: Message, text: Callable[[str], str], guarded: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"role": m.role, "content": text(m.content)}
        if m.reasoning_content is not None:
            out["reasoning_content"] = text(m.reasoning_content)
        if m.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": self._arguments(c.arguments, guarded)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
        return out

    def _arguments(self, arguments: str, guarded: bool) -> str:
        if not guarded or self._reads_as_text(arguments):
            return arguments
        try:
            text = json.dumps(_escaped(json.loads(arguments)), ensure_ascii=False)
        except ValueError:  # not JSON (a client's history may hold anything): escaped all the same
            text = _escaped(arguments)
        return _MARKED.sub(lambda m: "\\u" + m.group(1), text)


def _escaped(value: Any) -> Any:
    """Strings with control tokens' marks held (written as \\uXXXX once dumped)."""
    if isinstance(value, str):
        return "".join(_MARKS.get(c, c) for c in value)
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    return value
