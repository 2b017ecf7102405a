"""Ollama's API over the fleet: POST /api/generate, POST /api/chat, GET /api/tags, /api/ps,
/api/version, with Ollama's field names.

The listings describe each model from its pool's model card (dispatcher/gateway/ollama_show.py):
name, file size and sha256, details, the file's time; /api/ps the workers' RAM and their tokens
per job. An empty prompt (or no messages) loads the model; with `keep_alive` 0 it unloads it,
which only an operator may do (docs/gateway.md, "Load and unload"); a prompt with `keep_alive` 0
is answered, then its model unloaded. `think` asked of a model that does not think is a 400.

Streams are NDJSON (the default; `"stream": false` gives one object); the final object has
`done: true`, `done_reason` and the counts and durations (nanoseconds) Ollama reports. Errors are
{"error": "..."}: with a status before the stream starts, as a line once it has. `options` that
only say how Ollama itself loads a model (num_ctx, num_thread, ...) are ignored, since the
fleet's workers decide that; sampling options this gateway cannot honour are a 400.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backends.contract.catalogue import duration_seconds
from backends.contract.tools import AnswerReader
from dispatcher.gateway.core import (
    ApiError,
    Gateway,
    JobUpdate,
    cancel_all,
    shown,
    unsupported,
)
from dispatcher.gateway.following import collect, follow
from dispatcher.gateway.models_api import keep_alive_field, listed, load, model_entry, unload
from dispatcher.gateway.ollama_show import listed_cards
from dispatcher.gateway.openai_api import check_limits, read_body, submit, timed_out
from dispatcher.gateway.openai_bodies import answers_in_json
from dispatcher.gateway.openai_tools import tool_fields
from dispatcher.gateway.reasoning import ollama_think, reasoning_fields
from dispatcher.gateway.responses import JobStreamResponse, unless_client_leaves

# The Ollama release whose API this gateway speaks, not llama-fleet's own version: clients gate
# features on it (the ollama CLI, Open WebUI and others check a minimum before they use a field),
# so it must be at least as new as the newest Ollama feature served here: `logprobs` and
# `top_logprobs` on /api/generate and /api/chat, which Ollama added in 0.12.11 (the others served:
# tool calls with `tool_name`, /api/embed's `dimensions`, /api/show's `capabilities`, are older).
# Raise it with the next Ollama feature this gateway takes, never past what it serves.
OLLAMA_API_VERSION = "0.12.11"
OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
           "min_p": "min_p", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "seed": "seed", "stop": "stop"}
LOAD_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa",
                "low_vram", "vocab_only", "f16_kv", "num_keep"}
COMMON_FIELDS = {"model", "format", "options", "stream", "keep_alive", "logprobs", "top_logprobs", "think"}
GENERATE_FIELDS = COMMON_FIELDS | {"prompt", "system", "raw"}
# tool_choice: llama-fleet's extension (OpenAI's values): Ollama's API cannot force a call
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools", "tool_choice"}
ROLES = ("system", "user", "assistant", "tool")
# beside role and content
ROLE_FIELDS = {"tool": ("tool_name", "name"), "assistant": ("tool_calls", "thinking")}
# Ollama's deprecated `context` (a conversation's token ids, sent back by the client) is not
# kept or taken: docs/gateway.md, "Ollama's context"
NO_CONTEXT = ("'context' (token ids of an earlier /api/generate) is not taken: send the conversation "
              "to /api/chat as messages instead")


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": err.message}


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


async def tags(request: Request) -> Response:
    """The caller's models, one entry each under the name its listings use (Ollama: the models it
    has, loaded or not)."""
    gw: Gateway = request.app.state.gateway
    models = listed(gw, request)
    cards = await listed_cards(gw, [m.pool for m in models])
    return JSONResponse({"models": [model_entry(m.name, cards[m.pool]) for m in models]})


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_API_VERSION})


async def generate(request: Request) -> Response:
    return await _run(request, chat=False)


async def chat(request: Request) -> Response:
    return await _run(request, chat=True)


def zero_duration(keep_alive: object) -> bool:
    """Whether `keep_alive` is zero, as Ollama reads it (a number of seconds, or a Go duration
    such as "0", "0s", "0m"): the request then unloads the model."""
    return duration_seconds(keep_alive) == 0


def refuse_thinking(gw: Gateway, pool: str, body: dict[str, Any]) -> None:
    """Ollama's 400 (in its words) for `think` asked of a model without the thinking capability.
    Known of a pool whose live workers describe their model; a catalogue model's template is read
    by the worker that loads it, so its `think` goes on to the template."""
    enable, _ = ollama_think(body.get("think"))  # a bad value: a 400 naming it
    if enable and gw.live_workers.get(pool) and pool not in gw.thinking_pools | gw.catalogue_pools:
        raise ApiError(400, f'"{shown(body.get("model"))}" does not support thinking', param="think",
                       code="invalid_value")


async def unload_after(request: Request, pool: str, body: dict[str, Any]) -> None:
    """Ollama's `keep_alive` 0 on a request that ran: its model is unloaded once it answered
    (marked, as an unload marks it), where the caller may unload (a tenant's keep_alive is left
    out, as any of its keep_alive hints)."""
    gw: Gateway = request.app.state.gateway
    if zero_duration(body.get("keep_alive")) and gw.may_unload(request.state.caller):
        with contextlib.suppress(ApiError):  # Redis away: the answer still goes, the model stays listed
            await gw.set_unloaded(pool, True)


def job_fields(body: dict[str, Any], chat: bool, thinks: bool = False) -> dict[str, Any] | None:
    """The fleet request for an Ollama body; None for an empty prompt (Ollama: load the model).
    `thinks`: the pool's model thinks (its thoughts come back as `thinking`)."""
    fields = _job_fields(body, chat)
    if fields is not None and "messages" in fields:  # a template renders them: it may think
        enable, effort = ollama_think(body.get("think"))
        # think false: no thought at all, also where the template cannot switch it off (gpt-oss)
        fields.update(reasoning_fields(thinks, effort=effort, enable=enable,
                                       budget=(0 if enable is False else None, "think")))
    return fields


def _job_fields(body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    if refused := unsupported_fields(body, chat):
        error = unsupported(refused, "Ollama")
        if "context" in refused:
            error.message += f"; {NO_CONTEXT}"
        raise error
    fields = _options(body.get("options") or {})
    fmt = body.get("format")
    if fmt not in (None, ""):
        if fmt != "json" and not isinstance(fmt, dict):
            raise ApiError(400, "format must be \"json\" or a JSON schema object", param="format")
        fields["format"] = fmt
    if "logprobs" in body:
        fields["logprobs"] = body["logprobs"]
    if "top_logprobs" in body:
        fields["top_logprobs"] = body["top_logprobs"]
    if chat:
        messages = _messages(body.get("messages"))
        if body.get("tools"):  # Ollama's tools are OpenAI's function tools; the model may call any
            fields.update(tool_fields({k: body[k] for k in ("tools", "tool_choice") if k in body}))
        return {**fields, "messages": messages} if messages else None
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string", param="prompt")
    if not prompt:
        return None
    if body.get("system"):  # a system prompt needs the chat form (a template) to mean anything
        return {**fields, "messages": [{"role": "system", "content": str(body["system"])},
                                       {"role": "user", "content": prompt}]}
    return {**fields, "prompt": prompt}


def unsupported_fields(body: dict[str, Any], chat: bool) -> list[str]:
    """Every field of the body this gateway cannot honour, in the body's order (clients send
    empty tools/images and think: false: no use, so not refused)."""
    known = CHAT_FIELDS if chat else GENERATE_FIELDS
    out = [name for name, value in body.items() if name not in known and value not in ([], {}, "", False)]
    options = body.get("options")
    if isinstance(options, dict):
        out += [f"options.{name}" for name, value in options.items()
                if name not in OPTIONS and name not in LOAD_OPTIONS and value is not None]
    messages = body.get("messages") if chat else None
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(m, dict):
            allowed = ("role", "content", *ROLE_FIELDS.get(str(m.get("role")), ()))
            out += [f"messages[{i}].{name}" for name, value in m.items() if name not in allowed and value]
    return out


def _options(options: object) -> dict[str, Any]:
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object", param="options")
    fields: dict[str, Any] = {}
    for name, value in options.items():
        if name in LOAD_OPTIONS or value is None:
            continue
        fields[OPTIONS[name]] = value
    if isinstance(fields.get("max_tokens"), int) and fields["max_tokens"] <= 0:
        del fields["max_tokens"]  # -1: until the end; -2: fill the context. The worker's limit rules
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    return fields


def _messages(messages: object) -> list[dict[str, Any]]:
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise ApiError(400, "messages must be a list", param="messages")
    out = []
    for i, m in enumerate(messages):
        text = m.get("content") or "" if isinstance(m, dict) else None
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(text, str):
            raise ApiError(400, f"messages[{i}] needs a role ({', '.join(ROLES)}) and text content",
                           param=f"messages[{i}]")
        message: dict[str, Any] = {"role": m["role"], "content": text}
        if m["role"] == "tool" and (m.get("tool_name") or m.get("name")):
            message["name"] = m.get("tool_name") or m.get("name")
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _history_calls(m["tool_calls"], i)
        if m["role"] == "assistant" and isinstance(m.get("thinking"), str) and m["thinking"]:
            message["reasoning_content"] = m["thinking"]
        out.append(message)
    return out


def _history_calls(calls: object, i: int) -> list[dict[str, Any]]:
    """An assistant message's Ollama tool calls ({"function": {"name", "arguments": {...}}}, no
    ids) as the fleet's."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        spec = call.get("function") if isinstance(call, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            shape = '{"function": {"name": ..., "arguments": {...}}}'
            raise ApiError(400, f"{where}[{j}] must be {shape}", param=where)
        arguments = spec.get("arguments") or {}
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        out.append({"id": str(call.get("id") or f"call_{i}_{j}"), "name": spec["name"], "arguments": text})
    return out


async def _run(request: Request, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    started = time.monotonic_ns()
    body = await read_body(request)
    model = body.get("model")
    caller = request.state.caller
    pool = gw.pool_for(model, caller)
    refuse_thinking(gw, pool, body)
    fields = job_fields(body, chat, thinks=pool in gw.thinking_pools)
    reply = OllamaReply(str(model), chat, started, tools=bool(fields and answers_in_json(fields)))
    if fields is None:  # Ollama loads the model, or with keep_alive 0 unloads it
        if zero_duration(body.get("keep_alive")):
            await unload(request, pool, model)
            return JSONResponse(reply.final(None, "", done_reason="unload"))
        took = await load(request, pool)
        return JSONResponse({**reply.final(None, "", done_reason="load"), "load_duration": int(took * 1e9)})
    fields.update(keep_alive_field(body, gw, request))
    check_limits(gw, [fields], 1, tokens_field="options.num_predict")
    jobs, headers = await submit(request, pool, [fields])
    timeout = gw.settings.gateway.request_timeout
    then = functools.partial(unload_after, request, pool, body)
    if body.get("stream", True):
        return JobStreamResponse(reply.ndjson(follow(jobs, timeout), jobs[0].id, then),
                                 media_type="application/x-ndjson", on_disconnect=lambda: cancel_all(jobs),
                                 headers=headers)
    finals = await unless_client_leaves(request, collect(jobs, timeout), lambda: cancel_all(jobs))
    if finals is None:
        return Response(status_code=499)
    if late := timed_out(finals, headers):
        raise late
    if finals[0].error is not None:  # as on the OpenAI paths: not 5xx, which clients would retry
        raise ApiError(422, f"generation failed: {finals[0].error}", code="job_failed", headers=headers)
    await then()
    result = finals[0].result or {}
    whole = reply.final(result, reply.words(result), calls=result.get("tool_calls"),
                        thinking=result.get("reasoning_content") or "")
    return JSONResponse(whole, headers=headers)


class OllamaReply:
    def __init__(self, model: str, chat: bool, started_ns: int, tools: bool = False) -> None:
        self.model = model
        self.chat = chat
        self.started_ns = started_ns
        self.tools = tools  # the job streams the answer JSON: words, calls and thoughts apart

    def _text(self, text: str, calls: list[dict[str, Any]] | None = None,
              thinking: str = "") -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [ollama_call(c) for c in calls]
            return {"message": message}
        return {"response": text, **({"thinking": thinking} if thinking else {})}

    def words(self, result: dict[str, Any]) -> str:
        return (result.get("content") or "") if "tool_calls" in result else result.get("text", "")

    def chunk(self, text: str, calls: list[dict[str, Any]] | None = None,
              thinking: str = "") -> dict[str, Any]:
        return {"model": self.model, "created_at": now_iso(), **self._text(text, calls, thinking),
                "done": False}

    def final(self, result: dict[str, Any] | None, text: str, done_reason: str | None = None,
              calls: list[dict[str, Any]] | None = None, thinking: str = "") -> dict[str, Any]:
        """The last object: done, why, token counts and durations in ns (from the job's timings)."""
        out = {"model": self.model, "created_at": now_iso(), **self._text(text, calls, thinking),
               "done": True}
        if result is None:
            return {**out, "done_reason": done_reason or "stop"}
        usage = result.get("usage") or {}
        timings = result.get("timings") or {}
        ttft_ms = timings.get("ttft_ms") or 0.0
        gen_ms = max(0.0, (timings.get("total_ms") or 0.0) - ttft_ms)
        out.update({
            "done_reason": "length" if result.get("finish_reason") == "length" else "stop",
            "total_duration": time.monotonic_ns() - self.started_ns,
            # the wait for a free slot, and for the model's load when the job's start loaded it
            "load_duration": int(((timings.get("queue_ms") or 0.0) + (timings.get("load_ms") or 0.0)) * 1e6),
            "prompt_eval_count": usage.get("prompt_tokens", 0),
            "prompt_eval_duration": int(ttft_ms * 1e6),
            "eval_count": usage.get("completion_tokens", 0),
            "eval_duration": int(gen_ms * 1e6),
        })
        if result.get("logprobs"):
            out["logprobs"] = result["logprobs"]
        return out

    async def ndjson(self, updates: AsyncIterator[JobUpdate], job_id: str = "",
                     then: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[str]:
        """The stream's lines; `then` runs once the job ended, before the last line goes."""
        reader = AnswerReader(job_id) if self.tools else None
        async for u in updates:
            if u.error is not None:
                yield line({"error": u.error})
                return
            if reader is not None:  # the raw JSON becomes the words and calls it holds
                words, calls = reader.feed(u.delta)
                thinking = reader.take_reasoning()
                if words or calls or thinking:
                    yield line(self.chunk(words, calls, thinking))
            elif u.delta:
                yield line(self.chunk(u.delta))
            if u.result is not None:
                if then is not None:
                    await then()
                yield line(self.final(u.result, ""))


def ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    """A result's call in Ollama's shape: the arguments as an object, not JSON text."""
    return {"function": {"name": call["name"], "arguments": json.loads(call["arguments"])}}


def line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"

