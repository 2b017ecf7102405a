"""OpenAI's request and response bodies, without HTTP: an OpenAI body -> fleet job fields
(`job_fields`), and fleet results -> OpenAI's completion objects (`Reply`), errors (`error_body`).

Shared by the HTTP handlers (openai_api.py) and batches (dispatcher/gateway/batch), which turn every line of
a batch file into a job and every result into the body the same request would have answered.
Imports nothing from Starlette, so producer-only hosts can use it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from dispatcher.gateway.core import ApiError, JobUpdate, unsupported
from dispatcher.gateway.openai_tools import (
    TOOL_FIELDS,
    ToolDeltas,
    assistant_calls,
    message_fields,
    tool_fields,
)
from dispatcher.gateway.reasoning import BUDGET_FIELDS, budget_field, reasoning_fields

# llama-server's and vLLM's extensions to OpenAI's bodies (the openai SDK sends them as extra_body)
EXTENSION_FIELDS = ("ignore_eos", "min_tokens")
COMMON_FIELDS = {"model", "stream", "stream_options", "n", "stop", "seed", "max_tokens", "temperature",
                 "top_p", "presence_penalty", "frequency_penalty", "logprobs", "user", "response_format",
                 "prompt_cache_key", "logit_bias", *EXTENSION_FIELDS}
# llama-server's thinking fields (dispatcher/gateway/reasoning.py)
REASONING_FIELDS = ("reasoning_format", "chat_template_kwargs", "reasoning_effort", *BUDGET_FIELDS)
CHAT_FIELDS = COMMON_FIELDS | TOOL_FIELDS | {"messages", "max_completion_tokens", "top_logprobs",
                                             *REASONING_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
SAMPLING_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
MAX_CHOICES = 16
MESSAGE_FIELDS = ("role", "content", "name")  # and by role: ROLE_FIELDS
ROLE_FIELDS = {"tool": ("tool_call_id",), "assistant": ("tool_calls", "reasoning_content")}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
FINISH_REASONS = ("length", "tool_calls")  # as the result says; every other ending is "stop"


def error_body(err: ApiError) -> dict[str, Any]:
    kind = err.kind or ("invalid_request_error" if err.status < 500 else "server_error")
    if err.status == 401:
        kind = "authentication_error"
    param = OPENAI_PARAM.get(err.param or "", err.param)
    return {"error": {"message": err.message, "type": kind, "param": param, "code": err.code}}


# fleet request fields whose OpenAI name differs (a 400's `param` names the field the client sent)
OPENAI_PARAM = {"format": "response_format", "json_schema": "response_format",
                "cache_key": "prompt_cache_key"}


def job_fields(body: dict[str, Any], chat: bool, thinks: bool = False) -> tuple[list[dict[str, Any]], int]:
    """The fleet requests (one per prompt) and n, from an OpenAI body; 400 naming a bad field.
    `thinks`: the pool's model thinks (its thoughts come apart unless the body says otherwise)."""
    if refused := unsupported_fields(body, chat):
        raise unsupported(refused, "OpenAI")
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be an integer from 1 to {MAX_CHOICES}", param="n",
                       code="invalid_value")
    fields: dict[str, Any] = {k: body[k] for k in (*SAMPLING_FIELDS, *EXTENSION_FIELDS, "seed", "logit_bias")
                              if k in body}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    if "stop" in body:
        fields["stop"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
    fields.update(_logprobs(body, chat))
    # which worker a request goes to: where the same cache key (else the same user) ran last
    user = body.get("user")
    hint = body.get("prompt_cache_key", user if isinstance(user, str) and 0 < len(user) <= 256 else None)
    if hint is not None:
        fields["cache_key"] = hint
    if "response_format" in body:
        fields.update(_response_format(body["response_format"]))
    if chat:
        fields.update(reasoning_fields(thinks, fmt=body.get("reasoning_format"),
                                       effort=body.get("reasoning_effort"),
                                       kwargs=body.get("chat_template_kwargs"), budget=budget_field(body)))
        return [{**fields, **tool_fields(body), "messages": _messages(body.get("messages"))}], n
    return [{**fields, "prompt": p} for p in _prompts(body.get("prompt"))], n


def unsupported_fields(body: dict[str, Any], chat: bool) -> list[str]:
    """Every field of the body this gateway cannot honour, in the body's order: unknown fields,
    `echo` on completions, unknown message fields, non-text content parts, unknown
    stream_options."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    out = [name for name in body if name not in known]
    if not chat and body.get("echo"):
        out.append("echo")
    options = body.get("stream_options")
    if isinstance(options, dict):
        out += [f"stream_options.{name}" for name in options if name != "include_usage"]
    messages = body.get("messages") if chat else None
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(m, dict):
            continue  # _messages names the shape
        role = ROLES.get(m["role"], "") if isinstance(m.get("role"), str) else ""
        allowed = (*MESSAGE_FIELDS, *ROLE_FIELDS.get(role, ()))
        out += [f"messages[{i}].{name}" for name, value in m.items()
                if name not in allowed and value is not None]
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                out.append(f"messages[{i}].content[{j}] (only text parts)")
    return out


def _logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    if chat:
        out = {"logprobs": body["logprobs"]} if "logprobs" in body else {}
        if "top_logprobs" in body:
            out["top_logprobs"] = body["top_logprobs"]
        return out
    top = body.get("logprobs")  # legacy completions: an integer, how many alternatives (0-5)
    if top is None:
        return {}
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 5:
        raise ApiError(400, "'logprobs' must be an integer from 0 to 5", param="logprobs",
                       code="invalid_value")
    return {"logprobs": True, "top_logprobs": top}


def _response_format(fmt: object) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if isinstance(fmt, dict) and kind == "text":
        return {}
    if isinstance(fmt, dict) and kind == "json_object":
        return {"format": "json"}
    if isinstance(fmt, dict) and kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format", code="invalid_value")
        return {"format": schema}
    raise ApiError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'",
                   param="response_format", code="invalid_value")


def _messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role",
                           code="invalid_value")
        role = ROLES[m["role"]]
        message: dict[str, Any] = {"role": role}
        if m.get("tool_calls"):  # an earlier answer's calls: content may be null
            message["tool_calls"] = assistant_calls(m["tool_calls"], f"{where}.tool_calls")
            message["content"] = _content(m["content"], where) if m.get("content") is not None else ""
        else:
            message["content"] = _content(m.get("content"), where)
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            message["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(400, f"{where}.tool_call_id is required: the id of the call this result "
                               "answers", param=f"{where}.tool_call_id", code="invalid_value")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):  # (a part of another type is refused before)
                raise ApiError(400, f"{where}.content[{j}].text must be a string",
                               param=f"{where}.content", code="invalid_value")
            texts.append(text)
        return "".join(texts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts",
                   param=f"{where}.content", code="invalid_value")


def _prompts(prompt: object) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string or a list of strings (token arrays are not supported)",
                   param="prompt", code="invalid_value")


def answers_in_json(fields: dict[str, Any]) -> bool:
    """Whether a job of these fields streams the answer JSON, its words, calls and thoughts apart
    (backends/contract/tools.py answers_in_json): tools offered (not 'none'), or thoughts apart."""
    calls = bool(fields.get("tools")) and fields.get("tool_choice") != "none"
    return calls or fields.get("reasoning_format") not in (None, "none")


def per_choice(requests: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """n jobs per request; with a seed, choice j uses seed + j so the choices differ."""
    out = []
    for fields in requests:
        for j in range(n):
            seed = fields.get("seed")
            out.append({**fields, "seed": (seed + j) % 2**32} if isinstance(seed, int) and j else fields)
    return out


# -- jobs -> response -----------------------------------------------------------------------------

class Reply:
    """OpenAI's response objects for one request's jobs."""

    def __init__(self, chat: bool, model: str, job_ids: Sequence[str], include_usage: bool,
                 created: float | None = None, tools: bool = False) -> None:
        self.chat = chat
        self.job_ids = list(job_ids)
        self.tools = tools  # the jobs stream the answer JSON: words, calls and thoughts apart
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + job_ids[0]
        self.created = int(created if created is not None else time.time())
        self.include_usage = include_usage
        self.n = len(job_ids)
        self._text_chunk_parts: dict[int, tuple[str, str]] = {}  # per choice: the event around a delta

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" + (".chunk" if chunk else "") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "llama-fleet"}

    def _logprobs(self, result: dict[str, Any] | None) -> dict[str, Any] | None:
        tokens = (result or {}).get("logprobs")
        if not tokens:
            return None
        if self.chat:
            return {"content": tokens, "refusal": None}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t["token"])
        tops = [{a["token"]: a["logprob"] for a in t.get("top_logprobs", [])} for t in tokens]
        return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, index: int, text: str, finish: str | None, result: dict[str, Any] | None,
                chunk: bool) -> dict[str, Any]:
        logprobs = self._logprobs(result)
        if not self.chat:
            return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
        body: dict[str, Any] = {"content": text} if text else {}
        if not chunk:
            body = {"role": "assistant", **message_fields(result), "refusal": None}
        return {"index": index, ("delta" if chunk else "message"): body, "logprobs": logprobs,
                "finish_reason": finish}

    def text_chunk(self, index: int, text: str) -> str:
        """The SSE event of one text delta: the most frequent thing a gateway writes (a token per
        event per user), so the event around the text is serialised once per choice, not per token
        (the same bytes as `sse_data` of the chunk dict)."""
        around = self._text_chunk_parts.get(index)
        if around is None:
            marker = "\u0000text\u0000"
            choice = self._choice(index, marker, None, None, chunk=True)
            usage = {"usage": None} if self.include_usage else {}
            whole = sse_data({**self._envelope(chunk=True), "choices": [choice], **usage})
            head, _, tail = whole.partition(json.dumps(marker))
            around = self._text_chunk_parts[index] = (head, tail)
        return around[0] + json.dumps(text) + around[1]

    @staticmethod
    def usage(results: list[dict[str, Any] | None]) -> dict[str, Any]:
        """The n choices' usage summed; cached: the prompt tokens the engines did not prefill."""
        used = [r.get("usage", {}) for r in results if r]
        prompt = sum(u.get("prompt_tokens", 0) for u in used)
        completion = sum(u.get("completion_tokens", 0) for u in used)
        cached = sum(u.get("cached_tokens", 0) for u in used)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def whole(self, finals: list[JobUpdate]) -> dict[str, Any]:
        failed = [u for u in finals if u.error is not None]
        if failed:
            raise ApiError(422, f"generation failed: {failed[0].error}", code="job_failed")
        choices = [self._choice(u.index, (u.result or {}).get("text", ""), finish_reason(u.result), u.result,
                                chunk=False) for u in finals]
        return {**self._envelope(chunk=False), "choices": choices,
                "usage": self.usage([u.result for u in finals])}

    async def sse(self, updates: AsyncIterator[JobUpdate]) -> AsyncIterator[str]:
        extra = {"usage": None} if self.include_usage else {}
        if self.chat:  # OpenAI opens each choice with its role
            for i in range(self.n):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield sse_data({**self._envelope(chunk=True), "choices": [first], **extra})
        results: list[dict[str, Any] | None] = [None] * self.n
        answers = [ToolDeltas(job_id) for job_id in self.job_ids] if self.tools else []
        async for u in updates:
            if u.error is not None:  # the status is sent already: the error travels as a chunk
                failure = (ApiError(504, u.error, code="timeout") if u.timed_out
                           else ApiError(422, f"generation failed: {u.error}", code="job_failed"))
                yield sse_data(error_body(failure))
                return
            results[u.index] = u.result
            if answers:  # the raw JSON becomes the words and calls it holds
                for delta in answers[u.index].deltas(u.delta):
                    yield self.delta_chunk(u.index, delta, extra)
                u.delta = ""
            if u.final:
                choice = self._choice(u.index, u.delta, finish_reason(u.result), u.result, chunk=True)
                yield sse_data({**self._envelope(chunk=True), "choices": [choice], **extra})
            elif u.delta:
                yield self.text_chunk(u.index, u.delta)
        if self.include_usage:
            yield sse_data({**self._envelope(chunk=True), "choices": [], "usage": self.usage(results)})
        yield "data: [DONE]\n\n"


    def delta_chunk(self, index: int, delta: dict[str, Any], extra: dict[str, Any]) -> str:
        if "content" in delta and len(delta) == 1:
            return self.text_chunk(index, delta["content"])
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return sse_data({**self._envelope(chunk=True), "choices": [choice], **extra})


def finish_reason(result: dict[str, Any] | None) -> str:
    reason = (result or {}).get("finish_reason")
    return reason if reason in FINISH_REASONS else "stop"


def sse_data(obj: dict[str, Any], event: str | None = None) -> str:
    """One SSE event, every stream's framing: its JSON data, after an `event:` line naming it
    where the API writes one (Anthropic's Messages and OpenAI's Responses streams; chat
    completions' chunks have none)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n"
