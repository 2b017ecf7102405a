"""A GGUF model's own Jinja chat template, rendered in Python as llama-server (`--jinja`) renders it.

The reference is the llama.cpp vendored in llama-cpp-python 0.3.36: its own Jinja engine
(common/jinja: lexer options, builtins, operators) and what common/chat.cpp does around it (messages
and tools rebuilt in llama.cpp's shape, capabilities probed by rendering trial chats, the
workarounds a missing capability turns on, the variables a render gets). Jinja2's
ImmutableSandboxedEnvironment runs the template; where llama.cpp's engine answers otherwise (none
prints as "", `default` also replaces none, `tojson` keeps UTF-8 and has its own separators, a
string `+`/`~` none is the string), the difference is patched in here. A last assistant message
is rendered as a finished turn, as llama-server does with --no-prefill-assistant (by default it
continues that turn instead).

    tpl = ChatTemplate(source, bos_token="<bos>", eos_token="<eos>", add_bos=True)
    prompt = tpl.render(messages, tools=tools, extra={"enable_thinking": False})
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2 import ChainableUndefined, TemplateSyntaxError, Undefined
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat, Impossible
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_OUTPUT_CHARS = 4 * 1024 * 1024  # past this a template is hostile, not a chat
MAX_LOOP_STEPS = 1_000_000  # range() steps in one render: nested loops multiply
MAX_RANGE = 100_000  # one range(), as Jinja2's sandbox caps it


class TemplateError(ValueError):
    """The template did not compile, raised (raise_exception), broke the sandbox or a limit."""


@dataclass(frozen=True)
class TemplateCaps:
    supports_tools: bool
    supports_tool_calls: bool
    supports_tool_responses: bool
    supports_system_role: bool
    supports_parallel_tool_calls: bool
    requires_object_arguments: bool
    thinking: bool
    # content as a string / as [{"type": "text", ...}] parts: llama.cpp converts to the one a
    # template takes when it takes only one
    supports_string_content: bool = True
    supports_typed_content: bool = False


class _Limit(SecurityError):
    """A render went past a size or step limit: the template is hostile, whatever the chat."""


@dataclass
class _Render:
    guard: Callable[[str], str] | None
    chars: int = 0  # every piece printed, what macros and {% set %} blocks buffer included
    steps: int = 0  # range() steps


_STATE: ContextVar[_Render | None] = ContextVar("jinja_template_render", default=None)


def _charge(chars: int = 0, steps: int = 0) -> None:
    if (state := _STATE.get()) is not None:
        state.chars, state.steps = state.chars + chars, state.steps + steps
        if state.chars > MAX_OUTPUT_CHARS or state.steps > MAX_LOOP_STEPS:
            raise _Limit(f"template printed past {MAX_OUTPUT_CHARS} characters or looped past "
                         f"{MAX_LOOP_STEPS} steps")


def _text(v: Any) -> str:
    """A value as text, as llama.cpp's as_string (a float through std::to_string, zeros cut)."""
    if v is None or isinstance(v, Undefined):
        return ""
    if isinstance(v, float):
        text = f"{v:.6f}".rstrip("0")
        return text + "0" if text.endswith(".") else text
    return str(v)


def _finalize(v: Any) -> str:
    """What `{{ v }}` prints: none, objects and undefined print nothing, a list its items."""
    text = "" if isinstance(v, Mapping) else _text(v) if not isinstance(v, list | tuple) \
        else "".join(_finalize(x) for x in v)
    _charge(len(text))
    return text


def _json(v: Any, indent: int | None, seps: tuple[str, str], ascii_: bool, level: int = 0) -> str:
    """llama.cpp's value_to_json: insertion order, floats as C++ streams them (%g), each string
    through the render's guard before it is escaped."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return f"{v:g}" if isinstance(v, float) else str(v)
    if isinstance(v, str):
        state = _STATE.get()
        return json.dumps(state.guard(v) if state and state.guard else v, ensure_ascii=ascii_)
    if isinstance(v, Mapping):
        body = [_json(_text(k), None, seps, ascii_) + seps[1] + _json(v[k], indent, seps, ascii_, level + 1)
                for k in v]
        open_, close = "{", "}"
    elif isinstance(v, list | tuple):
        body = [_json(x, indent, seps, ascii_, level + 1) for x in v]
        open_, close = "[", "]"
    else:
        return "null"  # none, undefined, anything else
    if not body or indent is None:
        return open_ + seps[0].join(body) + close
    pad = "\n" + " " * indent * (level + 1)
    return open_ + pad + (seps[0] + pad).join(body) + "\n" + " " * indent * level + close


def _tojson(value: Any, ensure_ascii: Any = False, indent: Any = None, separators: Any = None,
            sort_keys: Any = False) -> str:
    """llama.cpp's tojson, its arguments in its order: UTF-8 kept unless ensure_ascii; ", " and
    ": " separators, "," and ": " when indented."""
    if sort_keys:
        raise TemplateError("tojson sort_keys=true is not implemented (llama.cpp)")
    width = indent if isinstance(indent, int) and not isinstance(indent, bool) else None
    seps = [_text(s) for s in separators] if isinstance(separators, list | tuple) else []
    seps += ["," if width is not None else ", ", ": "][len(seps):]
    text = _json(value, width, (seps[0], seps[1]), bool(ensure_ascii))
    _charge(len(text))
    return text


def _default(value: Any, default_value: Any = "", boolean: bool = False) -> Any:
    # llama.cpp's default replaces none too (Jinja2's only undefined)
    if isinstance(value, str):
        return default_value if boolean and not value else value
    missing = not value if boolean else value is None or isinstance(value, Undefined)
    return default_value if missing else value


class _Steps(list[int]):
    """range()'s list: each step of a loop over it counts against the render's budget."""

    def __iter__(self) -> Iterator[int]:
        for i in super().__iter__():
            _charge(steps=1)
            yield i


def _range(*args: int) -> list[int]:
    if len(values := range(*args)) > MAX_RANGE:
        raise _Limit(f"range() longer than {MAX_RANGE}")
    return _Steps(values)


def _raise(message: Any) -> None:
    raise TemplateError(_text(message))  # the template's own words are the error


class _Codegen(CodeGenerator):
    """`a ~ b` through the environment (Jinja2 joins str() of each: "None" for none), and no
    output folded at compile time: every piece, literal text too, goes through _finalize."""

    def _output_child_to_const(self, node: Any, frame: Frame, finalize: Any) -> str:
        raise Impossible()

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Env(ImmutableSandboxedEnvironment):
    code_generator_class = _Codegen
    intercepted_binops = frozenset({"+", "*"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and (isinstance(left, str) or isinstance(right, str)) \
                and not isinstance(left, Mapping) and not isinstance(right, Mapping):
            return self.concat_values((left, right))  # llama.cpp: "a" + 1 == "a1", "a" + none == "a"
        seq, times = (left, right) if isinstance(left, str | list) else (right, left)
        if operator == "*" and isinstance(seq, str | list) and isinstance(times, int) \
                and len(seq) * times > MAX_OUTPUT_CHARS:
            raise _Limit(f"repetition longer than {MAX_OUTPUT_CHARS}")
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, list) and len(result) > MAX_OUTPUT_CHARS:  # [x] + [x], doubled in a loop
            raise _Limit(f"list longer than {MAX_OUTPUT_CHARS}")
        return result

    def concat_values(self, values: tuple[Any, ...]) -> str:
        text = "".join(_text(v) for v in values)
        if len(text) > MAX_OUTPUT_CHARS:
            raise _Limit(f"string longer than {MAX_OUTPUT_CHARS}")
        return text

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        # Jinja2 answers with an undefined that prints as "": an escape attempt fails instead
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("split", "rsplit"):
            method = getattr(str, attribute)  # llama.cpp splits on " " by default, not any space
            return lambda sep=" ", maxsplit=-1: method(obj, " " if sep is None else sep, maxsplit)
        return super().getattr(obj, attribute)


# llama.cpp replaces these lines before compiling: they reject content llama.cpp writes itself
_PATCHES = (
    ("<|channel|>", '{%- if "<|channel|>analysis<|message|>" in message.content or '
                    '"<|channel|>final<|message|>" in message.content %}'),
    ("[TOOL_CALLS]", "{%- if (message['content'] is none or message['content'] == '' or "
                     "message['content']|length == 0) and (message['tool_calls'] is not defined or "
                     "message['tool_calls'] is none or message['tool_calls']|length == 0) %}"),
)


class _Probe(dict[str, Any]):
    """A dict that notes which keys the template read: llama.cpp's capability probe asks whether
    a trial value was used at all, not only whether it was printed."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self._read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._read.add(key)
        return super().get(key, default)

    def items(self) -> Any:
        self._read.update(self)
        return super().items()


class _ProbeStr(str):
    """Content whose test as a string or use as parts (iterated, indexed) is noted."""

    tested = parts = False

    def __iter__(self) -> Iterator[str]:
        self.parts = True
        return super().__iter__()

    def __getitem__(self, key: Any) -> str:
        self.parts = self.parts or isinstance(key, int)
        return super().__getitem__(key)


class _ProbeList(list[Any]):
    parts = False

    def __iter__(self) -> Iterator[Any]:
        self.parts = True
        return super().__iter__()


def _track(v: Any) -> Any:
    if isinstance(v, dict):
        return _Probe({k: _track(x) for k, x in v.items()})
    return [_track(x) for x in v] if isinstance(v, list) else v


def _is_string(v: Any) -> bool:
    if isinstance(v, _ProbeStr):
        v.tested = True
    return isinstance(v, str)


_USER = {"role": "user", "content": "User message"}


def _trial(*args: Any) -> list[Any]:
    """caps_get's tool chat: a call (one per args), its result, an answer, a new question."""
    calls = [{"id": f"call0000{i + 1}", "type": "function", "function": {"name": "tool1", "arguments": a}}
             for i, a in enumerate(args)]
    return _track([_USER, {"role": "assistant", "content": "", "tool_calls": calls},
                   {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
                   {"role": "assistant", "content": "The tool response was 'tool response'"}, _USER])


_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
        "required": ["arg"]}}}]


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI message as llama.cpp rebuilds it (common_chat_msg::to_json_oaicompat): content
    always there ("" for none), empty fields and other keys dropped, arguments a JSON string."""
    if "role" not in m or ("content" not in m and "tool_calls" not in m):
        raise TemplateError(f"a message needs a role and content or tool_calls: {m!r}")
    content = m.get("content")
    if isinstance(content, list):
        if any(p.get("type") not in ("text", "media_marker") for p in content):
            raise TemplateError(f"unsupported content part type in {content!r}")
        content = [{"type": p["type"], "text": p["text"]} for p in content]
    elif content is not None and not isinstance(content, str):
        raise TemplateError(f"content must be a string or a list of parts: {content!r}")
    out: dict[str, Any] = {"role": m["role"], "content": content or ""}
    out.update({k: m[k] for k in ("reasoning_content", "name", "tool_call_id") if m.get(k)})
    calls = []
    for call in m.get("tool_calls") or []:
        if call.get("type") != "function" or "function" not in call:
            raise TemplateError(f"unsupported tool call: {call!r}")
        args = call["function"]["arguments"]
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
        calls.append({"type": "function", "function": {"name": call["function"]["name"], "arguments": args}})
        calls[-1].update({"id": call["id"]} if call.get("id") else {})
    return {**out, "tool_calls": calls} if calls else out


def _tool(t: Mapping[str, Any]) -> dict[str, Any]:
    if t.get("type") != "function" or "function" not in t:
        raise TemplateError(f"unsupported tool: {t!r}")
    fn = t["function"]
    return {"type": "function", "function": {
        "name": fn["name"], "description": fn.get("description", ""), "parameters": fn.get("parameters", {})}}


def _join_parts(parts: list[dict[str, Any]]) -> str:
    # llama.cpp joins text parts with "\n", none next to a media marker
    text, after_media = "", False
    for part in parts:
        media = part["type"] == "media_marker"
        text += ("\n" if text and not media and not after_media else "") + part["text"]
        after_media = media
    return text


class ChatTemplate:
    """A chat template, compiled and its capabilities probed once. `add_bos` / `add_eos`: the
    model's tokenizer adds BOS (EOS) itself (GGUF tokenizer.ggml.add_bos_token): llama-server
    then cuts a leading bos_token (trailing eos_token) from the prompt, and so does render()."""

    caps: TemplateCaps

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 add_bos: bool = False, add_eos: bool = False) -> None:
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.add_bos, self.add_eos = add_bos, add_eos
        patched = source.replace("\r\n", "\n").replace("\r", "\n")
        for marker, line in _PATCHES:
            patched = patched.replace(line, "{%- if false %}") if marker in patched else patched
        # the templates llama.cpp renders through a dedicated route that rewrites the messages
        self._ministral = all(t in source for t in ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]")) \
            and "[CALL_ID]" not in source
        self._gpt_oss = not self._ministral and "<|channel|>" in source
        # llama.cpp's lexer: trim_blocks and lstrip_blocks on; no constant folding (see _Codegen)
        env = _Env(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                   undefined=ChainableUndefined, finalize=_finalize, autoescape=False, optimized=False)
        env.filters.update(tojson=_tojson, default=_default, d=_default)
        env.tests["string"] = _is_string
        env.globals.update(raise_exception=_raise, range=_range,
                           strftime_now=lambda fmt: time.strftime(fmt, time.localtime()))
        try:
            self._template = env.from_string(patched)
        except TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from e
        self.caps = self._probe_caps()

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, extra: dict[str, Any] | None = None,
               guard: Callable[[str], str] | None = None) -> str:
        """The prompt llama-server's /apply-template answers for the same request, `extra` being
        its chat_template_kwargs (which, unlike llama-server's, cannot replace the chat, the
        tools, the special tokens, the date or the template's functions). `guard` maps every
        string that tojson writes."""
        extra = dict(extra or {})
        if isinstance(extra.get("enable_thinking"), str):
            raise TemplateError('invalid type for "enable_thinking" (expected boolean, got string)')
        # llama-server's default: thinking on where the template knows it
        ctx: dict[str, Any] = {"enable_thinking": self.caps.thinking}
        if isinstance(keep := extra.get("preserve_reasoning"), bool):
            ctx.update(preserve_thinking=keep, clear_thinking=not keep,
                       truncate_history_thinking=not keep, drop_thinking=not keep)
        if isinstance(effort := extra.get("reasoning_effort"), str) and effort:
            ctx["reasoning_strength"] = effort
        # the request's settings never stand in for the template's own names: its functions, the
        # chat and the variables set below
        ctx.update((k, v) for k, v in extra.items() if k not in self._template.globals)
        now = time.localtime()
        ctx.update(messages=self._adapt([_message(m) for m in messages]), bos_token=self.bos_token,
                   eos_token=self.eos_token, datetime=time.strftime("%b %d %Y", now),
                   date_string=time.strftime("%d %b %Y", now))
        ctx.pop("tools", None)
        ctx.pop("add_generation_prompt", None)
        if tools:
            ctx["tools"] = [_tool(t) for t in tools]
        if add_generation_prompt:
            ctx["add_generation_prompt"] = True
        out = self._run(ctx, guard)
        if self._gpt_oss and not add_generation_prompt and (at := out.rfind("<|return|>")) >= 0:
            out = out[:at] + "<|end|>" + out[at + len("<|return|>"):]
        if self.add_bos and out.startswith(self.bos_token):
            out = out[len(self.bos_token):]
        if self.add_eos and self.eos_token and out.endswith(self.eos_token):
            out = out[: -len(self.eos_token)]
        return out

    def _adapt(self, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """llama.cpp's workarounds for what the template lacks, then its route's rewrites."""
        caps = self.caps
        for m in msgs:
            if isinstance(m["content"], list) and not caps.supports_typed_content:
                m["content"] = _join_parts(m["content"])
            elif isinstance(m["content"], str) and caps.supports_typed_content \
                    and not caps.supports_string_content:
                m["content"] = [{"type": "text", "text": m["content"]}]
            if m["role"] == "developer" and not self._gpt_oss:
                m["role"] = "system"
        if not caps.supports_system_role and msgs and msgs[0]["role"] == "system":
            first = msgs.pop(0)  # folded into the next message, else dropped
            if msgs:
                msgs[0]["content"] = f"{first['content']}\n{msgs[0]['content']}"
        for m in msgs:
            for call in m.get("tool_calls", []) if caps.requires_object_arguments else []:
                try:
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                except ValueError as e:
                    raise TemplateError(f"tool call arguments are not JSON: {e}") from e
            if self._gpt_oss and "reasoning_content" in m:
                m["thinking"] = m["reasoning_content"]  # the gpt-oss template reads "thinking"
                if m.get("tool_calls"):
                    del m["content"]
            if self._ministral and m["role"] in ("system", "assistant"):
                # content as blocks, the reasoning a "thinking" block first
                blocks = [{"type": "thinking", "thinking": m.pop("reasoning_content")}] \
                    if "reasoning_content" in m else []
                text = m["content"]
                m["content"] = blocks + (text if isinstance(text, list) else [{"type": "text", "text": text}])
        return msgs

    def _run(self, ctx: dict[str, Any], guard: Callable[[str], str] | None) -> str:
        token = _STATE.set(_Render(guard))
        try:
            chunks, total = [], 0
            for chunk in self._template.generate(ctx):
                total += len(chunk)
                if total > MAX_OUTPUT_CHARS:
                    raise _Limit(f"template output past {MAX_OUTPUT_CHARS} characters")
                chunks.append(chunk)
            return "".join(chunks)
        except TemplateError:
            raise
        except Exception as e:  # any Jinja2, sandbox or Python error inside the template
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        finally:
            _STATE.reset(token)

    def _try(self, messages: list[Any], tools: list[Any] | None = None, **extra: Any) -> str | None:
        """A trial render as llama.cpp's caps_get makes it; None when it fails (a limit fails the
        template at once: no trial should cost a second)."""
        ctx = {"messages": messages, "tools": tools or [], "bos_token": "", "eos_token": "",
               "add_generation_prompt": True, **extra}
        try:
            return self._run(ctx, None)
        except TemplateError as e:
            if isinstance(e.__cause__, _Limit):
                raise
            return None

    def _probe_caps(self) -> TemplateCaps:
        """llama.cpp's caps_get: a capability is there when the trial value was read."""
        marker, parts = _ProbeStr("STRING_MARKER"), _ProbeList()
        out = self._try([_Probe({"role": "user", "content": marker})])
        typed = marker.parts
        string = out is not None and not (typed and marker not in out)
        if marker.tested and self._try([_Probe({"role": "user", "content": parts})]) is not None:
            typed = typed or parts.parts
        chat = _track([{"role": "system", "content": "System message"}, _USER])
        self._try(chat)
        system = "content" in chat[0]._read
        tools, calls, object_args, responses = True, True, False, False
        for args in ({"arg": "value"}, '{"arg": "value"}'):
            chat, trial_tools = _trial(args), _track(_TOOLS)
            if self._try(chat, trial_tools) is None:
                if isinstance(args, str):  # a failed trial with object arguments tells nothing
                    tools = calls = False
                continue
            tools = "name" in trial_tools[0]["function"]._read
            calls = "tool_calls" in chat[1]._read
            responses = "content" in chat[2]._read
            fn = chat[1]["tool_calls"][0]["function"]
            object_args = isinstance(args, dict) and calls and "arg" in fn["arguments"]._read
            break
        chat = _trial(*[{"arg": "value"} if object_args else '{"arg": "value"}'] * 2)
        parallel = self._try(chat, _track(_TOOLS)) is not None \
            and "function" in chat[1]["tool_calls"][1]._read
        self.caps = TemplateCaps(tools, calls, responses, system, parallel, object_args, False, string, typed)
        # thinking: a past reasoning is printed, enable_thinking changes the prompt, or it opens a <think>
        said = self._adapt([dict(_USER), {"role": "assistant", "content": "Answer",
                                          "reasoning_content": "REASONING_MARKER"}])
        printed = "REASONING_MARKER" in (self._try(said, add_generation_prompt=False) or "")
        on, off = (self._try([dict(_USER)], enable_thinking=flag) for flag in (True, False))
        thinking = printed or on != off or "<think>" in (on or "") or self._gpt_oss
        return TemplateCaps(tools, calls, responses, system, parallel, object_args, thinking, string, typed)
