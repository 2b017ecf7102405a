"""Anthropic's Messages API bodies, without HTTP: a request (`system`, `messages` of text,
tool_use and tool_result blocks, `tools` with `input_schema`, `tool_choice`) -> one fleet job's
fields, and the job -> a Message object or its stream of events; errors in Anthropic's shape.

Tool shapes go through openai_tools.py (a tool_use block is an assistant's call, a tool_result
a `tool` message), so a call is generated, read and identified exactly as on chat completions.
Images, documents and server tools are a 400 naming them; `thinking` shows the thoughts apart
and sets their budget (reasoning.py). Imports nothing from Starlette.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from typing import Any

from backends.contract.tools import AnswerReader
from dispatcher.gateway.core import ApiError, JobUpdate, shown, unsupported
from dispatcher.gateway.openai_bodies import answers_in_json, sse_data
from dispatcher.gateway.openai_tools import invalid, tool_fields
from dispatcher.gateway.reasoning import reasoning_fields

API = "Anthropic"
# what shapes the prompt: all that POST /v1/messages/count_tokens reads (it takes a whole
# Messages body too, as proxies send it: the rest changes no count)
PROMPT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                 "cache_control"}
FIELDS = PROMPT_FIELDS | {"max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences",
                          "metadata", "service_tier"}
# keys a block or a tool may carry that change nothing here (prompt caching is automatic)
IGNORED_KEYS = {"cache_control", "citations", "eager_input_streaming"}
BLOCK_KEYS = {
    "text": {"type", "text"},
    "tool_use": {"type", "id", "name", "input"},
    "tool_result": {"type", "tool_use_id", "content", "is_error"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
TOOL_KEYS = {"type", "name", "description", "input_schema", "strict"}
THINKING_KEYS = {"type", "budget_tokens", "display"}
# output_config.effort -> the template's reasoning_effort
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}
CHOICE_KEYS = ("type", "name", "disable_parallel_tool_use")
MESSAGE_KEYS = ("role", "content")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               422: "api_error", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # every other ending: end_turn


def anthropic_route(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes (its error shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(err: ApiError) -> dict[str, Any]:
    """Anthropic's error shape; the type follows the status as Anthropic's do (a failed job's 422:
    api_error)."""
    kind = ERROR_TYPES.get(err.status) or ("invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# -- a request -> the job's fields -----------------------------------------------------------------


def job_request(body: dict[str, Any], thinks: bool = False) -> dict[str, Any]:
    """The fleet job's fields of a Messages body; 400 naming a field it cannot honour. `thinks`:
    the pool's model thinks (its thoughts come apart, as thinking blocks where asked for)."""
    refuse_unknown(body, FIELDS)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise invalid("max_tokens", "max_tokens: Field required (the most tokens the answer may have)")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise invalid("max_tokens", "max_tokens must be an integer of at least 1")
    fields: dict[str, Any] = {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}
    fields["max_tokens"] = max_tokens
    if "stop_sequences" in body:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("stop_sequences", "stop_sequences must be a list of strings")
        if stops:
            fields["stop"] = stops
    fields.update(_metadata(body.get("metadata")))
    if body.get("service_tier", "auto") not in ("auto", "standard_only"):
        raise invalid("service_tier", "service_tier must be 'auto' or 'standard_only'")
    return {**fields, **prompt_fields(body, thinks)}


def count_request(body: dict[str, Any], thinks: bool = False) -> dict[str, Any]:
    """The job POST /v1/messages/count_tokens runs: the prompt fields of a Messages body, one
    greedy token (the worker renders and tokenizes the prompt as for the real request)."""
    refuse_unknown(body, FIELDS)
    return {**prompt_fields(body, thinks), "max_tokens": 1, "temperature": 0.0}


def refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    if refused := [name for name in body if name not in known]:
        raise unsupported(refused, API)


def prompt_fields(body: dict[str, Any], thinks: bool = False) -> dict[str, Any]:
    """What shapes the prompt the worker runs: the messages, the tools and how they may be used,
    the answer's format, whether the model thinks (`thinking`: the template's enable_thinking)."""
    config = _output_config(body.get("output_config"))
    fields: dict[str, Any] = {"format": config["format"]} if "format" in config else {}
    fields.update(reasoning_fields(thinks, enable=thinking_enabled(body), budget=thinking_budget(body),
                                   effort=config.get("effort")))
    fields.update(_tools(body))
    messages = _messages(body.get("messages"))
    if "system" in body:
        system = _text(body["system"], "system")
        if system:
            messages.insert(0, {"role": "system", "content": system})
    return {**fields, "messages": messages}


def thinking_enabled(body: dict[str, Any]) -> bool | None:
    """Anthropic's `thinking`: {"type": "enabled", "budget_tokens": n} or {"type": "disabled"}
    (None: not said)."""
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive") or set(thinking) - THINKING_KEYS:
        raise invalid("thinking", 'thinking must be {"type": "enabled", "budget_tokens": N} or '
                      '{"type": "disabled"}')
    return kind != "disabled"


def thinking_budget(body: dict[str, Any]) -> tuple[object, str]:
    """The thought's budget `thinking` sets, for reasoning_fields: budget_tokens where enabled
    (the engine ends a thought that reaches it), 0 where disabled (no thought, even where the
    template opens one anyway); none where adaptive or not said. Anthropic asks for 1,024 tokens
    at least; a local model's budget may be smaller."""
    thinking = body.get("thinking")
    if thinking_enabled(body) is False:
        return 0, "thinking"
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return thinking.get("budget_tokens"), "thinking.budget_tokens"
    return None, "thinking"


def _metadata(metadata: object) -> dict[str, Any]:
    """metadata.user_id: the job's cache_key (the request goes where the same user's last ran)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise invalid("metadata", "metadata must be an object ({\"user_id\": ...})")
    refused = [f"metadata.{k}" for k, v in metadata.items() if k != "user_id" and v is not None]
    if refused:
        raise unsupported(refused, API)
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise invalid("metadata.user_id", "metadata.user_id must be a string")
    return {"cache_key": user} if user and len(user) <= 256 else {}


def _output_config(config: object) -> dict[str, Any]:
    """output_config's format (a JSON schema) and effort (the template's reasoning_effort: a local
    template knows low, medium and high, so Anthropic's xhigh and max ask for its highest)."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise invalid("output_config", "output_config must be an object ({\"format\": ...})")
    if refused := [f"output_config.{k}" for k, v in config.items() if k not in ("format", "effort")
                   and v is not None]:
        raise unsupported(refused, API)
    out: dict[str, Any] = {}
    if (effort := config.get("effort")) is not None:
        if not isinstance(effort, str) or effort not in EFFORTS:
            raise invalid("output_config.effort", f"output_config.effort must be one of {', '.join(EFFORTS)}")
        out["effort"] = EFFORTS[effort]
    fmt = config.get("format")
    if fmt is None:
        return out
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(schema, dict):
        raise invalid("output_config.format", 'output_config.format must be {"type": "json_schema", '
                      '"schema": {...}}')
    return {**out, "format": schema}


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """tools and tool_choice as the fleet's (through openai_tools.tool_fields)."""
    tools = body.get("tools")
    shaped: dict[str, Any] = {"tools": tools} if tools is not None else {}
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in (*CHOICES, "tool"):
            raise invalid("tool_choice", 'tool_choice must be {"type": "auto" | "any" | "none" | "tool"}')
        assert isinstance(choice, dict)
        if refused := [f"tool_choice.{k}" for k in choice if k not in CHOICE_KEYS]:
            raise unsupported(refused, API)
        if kind == "tool" and not isinstance(choice.get("name"), str):
            raise invalid("tool_choice.name", 'tool_choice {"type": "tool"} needs the name of the tool '
                          "to call")
        if tools or kind not in ("auto", "none"):  # without tools, auto and none ask for nothing
            shaped["tool_choice"] = CHOICES.get(kind) or {"type": "function", "name": choice["name"]}
        if choice.get("disable_parallel_tool_use") and tools:
            shaped["parallel_tool_calls"] = False
    return tool_fields(shaped, _tool, '{"name", "description", "input_schema"}')


def _tool(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(where, f"{where} must be a custom tool ({{\"name\", \"description\", "
                      f"\"input_schema\"}}); server tools ({shown(kind)}) are not supported")
    if refused := [f"{where}.{k}" for k, v in tool.items()
                   if k not in TOOL_KEYS and k not in IGNORED_KEYS and v is not None]:
        raise unsupported(refused, API)
    if not isinstance(tool.get("name"), str):
        raise invalid(f"{where}.name", f"{where}.name is required: the tool's name")
    if not isinstance(tool.get("input_schema"), dict):
        raise invalid(f"{where}.input_schema", f"{where}.input_schema is required: the JSON schema of the "
                      "tool's input")
    out = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        out["description"] = tool["description"]
    return out


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "messages must be a non-empty list of {\"role\", \"content\"}")
    said = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "assistant"]
    called = {b.get("id") for content in said if isinstance(content, list)
              for b in content if isinstance(b, dict) and b.get("type") == "tool_use"}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{where}.role", f"{where}.role must be 'user' or 'assistant'")
        if refused := [f"{where}.{k}" for k, v in m.items() if k not in MESSAGE_KEYS and v is not None]:
            raise unsupported(refused, API)
        blocks = _blocks(m.get("content"), f"{where}.content")
        if m["role"] == "assistant":
            if i == len(value) - 1:
                raise invalid(where, f"{where}: a last assistant message (prefill) is not supported: the "
                              "answer is always a new assistant turn; end with a user message")
            out.append(_assistant(blocks, where))
        else:
            out.extend(_user(blocks, where, called))
    return out


def _blocks(content: object, where: str) -> list[tuple[str, dict[str, Any]]]:
    """Content (at `where`) as (where, block) pairs, each block's type and keys checked."""
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise invalid(where, f"{where} must be a string or a list of content blocks")
    out = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("image", "document"):
            raise ApiError(400, f"{at} is an {kind} block: images and documents are not supported by this "
                           "gateway (llama-fleet serves text models); send text", param=at,
                           code="unsupported_field")
        if not isinstance(block, dict) or kind not in BLOCK_KEYS:
            raise unsupported(f"{at} (type {shown(kind)}; only text, tool_use and tool_result blocks)", API)
        if refused := [f"{at}.{k}" for k, v in block.items()
                       if k not in BLOCK_KEYS[kind] and k not in IGNORED_KEYS and v is not None]:
            raise unsupported(refused, API)
        if kind == "text" and not isinstance(block.get("text"), str):
            raise invalid(f"{at}.text", f"{at}.text must be a string")
        out.append((at, block))
    return out


def _assistant(blocks: list[tuple[str, dict[str, Any]]], where: str) -> dict[str, Any]:
    """An earlier answer: its words, and its tool_use blocks as the calls it made."""
    words, calls, thoughts = [], [], []
    for at, block in blocks:
        if block["type"] == "text":
            words.append(block["text"])
        elif block["type"] == "thinking":
            if isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
        elif block["type"] == "redacted_thinking":
            continue  # encrypted by another service: nothing a local model can read
        elif block["type"] == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise invalid(at, f"{at} (tool_use) needs id, name and input (an object)")
            calls.append({"id": block["id"], "name": block["name"],
                          "arguments": json.dumps(block["input"], ensure_ascii=False)})
        else:
            raise invalid(at, f"{at}: a {block['type']} block belongs in a user message")
    message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(words)}
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[tuple[str, dict[str, Any]]], where: str, called: set[Any]) -> list[dict[str, Any]]:
    """A user turn: its tool_result blocks as tool messages, its text as user messages, in order."""
    out: list[dict[str, Any]] = []
    for at, block in blocks:
        if block["type"] == "tool_use":
            raise invalid(at, f"{at}: a tool_use block belongs in an assistant message")
        if block["type"] == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n\n" + block["text"]
            else:
                out.append({"role": "user", "content": block["text"]})
            continue
        use_id = block.get("tool_use_id")
        if not isinstance(use_id, str):
            raise invalid(f"{at}.tool_use_id", f"{at}.tool_use_id is required: the id of the tool_use it "
                          "answers")
        if use_id not in called:  # Anthropic's words
            raise invalid(f"{at}.tool_use_id", f"unexpected `tool_use_id` found in `tool_result` blocks: "
                          f"{shown(use_id)}. Each `tool_result` block must have a corresponding `tool_use` "
                          "block in an earlier assistant message.")
        text = _text(block.get("content", ""), f"{at}.content")
        if block.get("is_error"):
            text = f"Error: {text}"
        out.append({"role": "tool", "tool_call_id": use_id, "content": text})
    return out


def _text(content: object, where: str) -> str:
    """A string or a list of text blocks (system, a tool's result) as one text; the blocks of a
    list (here as in a message) are paragraphs."""
    if not isinstance(content, str | list):
        raise invalid(where, f"{where} must be a string or a list of text blocks")
    texts = []
    for at, block in _blocks(content, where):
        if block["type"] != "text":
            raise invalid(at, f"{at} must be a text block")
        texts.append(block["text"])
    return "\n\n".join(texts)


# -- the job -> a Message --------------------------------------------------------------------------


class MessageReply:
    """The Message object of one job, whole or as Anthropic's stream of events."""

    def __init__(self, body: dict[str, Any], fields: dict[str, Any], job_id: str) -> None:
        self.job_id = job_id
        self.id = f"msg_{job_id}"
        self.model = body["model"]
        self.tools = answers_in_json(fields)  # the job streams the answer JSON
        self.thinking = bool(thinking_enabled(body))  # thoughts shown as thinking blocks

    def message(self, content: list[dict[str, Any]], result: dict[str, Any] | None) -> dict[str, Any]:
        reason, stop = None, None
        if result is not None:  # a stop string the caller sent ended it: which one
            finish = result.get("finish_reason", "")
            stop = result.get("stop_word") if finish == "stop" else None
            reason = "stop_sequence" if stop else STOP_REASONS.get(finish, "end_turn")
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop or None,
                "usage": usage(result)}

    def content(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        if "tool_calls" not in result:
            return [text_block(result.get("text", ""))]
        calls = [tool_use_block(c) for c in result.get("tool_calls") or []]
        words = result.get("content") or ""
        said = result.get("reasoning_content") if self.thinking else None
        thought = [thinking_block(said)] if said else []
        return [*thought, *([text_block(words)] if words or not calls else []), *calls]

    def whole(self, final: JobUpdate) -> dict[str, Any]:
        if final.error is not None:
            raise ApiError(422, f"generation failed: {final.error}", code="job_failed")
        result = final.result or {}
        return self.message(self.content(result), result)

    async def events(self, updates: AsyncIterator[JobUpdate]) -> AsyncIterator[str]:
        """message_start; each content block as it comes (content_block_start, its deltas:
        text_delta, or one input_json_delta with a call's whole input; content_block_stop), a
        ping after the first block opens; message_delta (stop_reason, usage) and message_stop.
        A failed job ends the stream with an `error` event."""
        yield event("message_start", message=self.message([], None))
        reader = AnswerReader(self.job_id) if self.tools else None
        blocks = 0  # content blocks opened
        text_open = thinking_open = False
        if reader is None:  # a plain answer is one text block: open it now
            blocks, text_open = 1, True
            for e in opened(0, text_block("")):
                yield e
        async for u in updates:
            if u.error is not None:
                failure = (ApiError(504, u.error, code="timeout") if u.timed_out
                           else ApiError(422, f"generation failed: {u.error}", code="job_failed"))
                yield event("error", error=error_body(failure)["error"])
                return
            words, calls = reader.feed(u.delta) if reader is not None else (u.delta, [])
            thought = reader.take_reasoning() if reader is not None and self.thinking else ""
            if thought and not thinking_open:
                blocks, thinking_open = blocks + 1, True
                for e in opened(blocks - 1, thinking_block("")):
                    yield e
            if thought:
                yield event("content_block_delta", index=blocks - 1,
                            delta={"type": "thinking_delta", "thinking": thought})
            if thinking_open and (words or calls or u.result is not None):
                thinking_open = False
                yield event("content_block_delta", index=blocks - 1,
                            delta={"type": "signature_delta", "signature": ""})
                yield event("content_block_stop", index=blocks - 1)
            if words and not text_open:
                blocks, text_open = blocks + 1, True
                for e in opened(blocks - 1, text_block("")):
                    yield e
            if words:
                yield text_delta(blocks - 1, words)
            for call in calls:
                if text_open:
                    text_open = False
                    yield event("content_block_stop", index=blocks - 1)
                block = tool_use_block(call)
                blocks += 1
                for e in opened(blocks - 1, {**block, "input": {}}):
                    yield e
                yield event("content_block_delta", index=blocks - 1,
                            delta={"type": "input_json_delta", "partial_json": call["arguments"]})
                yield event("content_block_stop", index=blocks - 1)
            if u.result is not None:
                if not blocks:  # an answer without words or calls is still one (empty) text block
                    blocks, text_open = 1, True
                    for e in opened(0, text_block("")):
                        yield e
                if text_open:
                    yield event("content_block_stop", index=blocks - 1)
                ended = self.message([], u.result)
                yield event("message_delta", delta={"stop_reason": ended["stop_reason"],
                                                    "stop_sequence": ended["stop_sequence"]},
                            usage=ended["usage"])
                yield event("message_stop")


def usage(result: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: input_tokens are those not read from the cache (the prompt's tokens are
    input_tokens + cache_read_input_tokens, as Anthropic counts them; cached: the prompt tokens
    the engine did not prefill). None (a stream's start): zeros, the true figures come with
    message_delta."""
    used = (result or {}).get("usage") or {}
    prompt, cached = used.get("prompt_tokens", 0), used.get("cached_tokens", 0)
    return {"input_tokens": prompt - cached, "output_tokens": used.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def opened(index: int, block: dict[str, Any]) -> list[str]:
    """A content block's start, and the ping Anthropic sends after the first one."""
    start = event("content_block_start", index=index, content_block=block)
    return [start, event("ping")] if index == 0 else [start]


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, Any]:
    """Thoughts as a thinking block; the signature is empty (no service signs a local model's)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call: dict[str, str]) -> dict[str, Any]:
    """A call as a tool_use block: its id (toolu_ + the call's hash, the same in a stream and a
    whole answer) and its arguments as the input object."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["name"],
            "input": json.loads(call["arguments"])}


def event(kind: str, **fields: Any) -> str:
    """One SSE event as Anthropic writes them: an `event:` line and data with the same `type`."""
    return sse_data({"type": kind, **fields}, kind)


def text_delta(index: int, text: str) -> str:
    """The most frequent event (a token per event): the same bytes as `event` of it, the event
    around the text serialised once per block."""
    head, tail = _around_text(index)
    return head + json.dumps(text) + tail


@functools.lru_cache(maxsize=64)
def _around_text(index: int) -> tuple[str, str]:
    marker = "\u0000text\u0000"
    whole = event("content_block_delta", index=index, delta={"type": "text_delta", "text": marker})
    head, _, tail = whole.partition(json.dumps(marker))
    return head, tail
