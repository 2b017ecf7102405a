"""OpenAI's Responses API bodies, without HTTP, stateless: a request (`input` text or items:
messages, function calls and their outputs; `instructions`, flat function `tools`) -> one fleet
job's fields, and the job -> a Response object or its stream of events.

Nothing is stored: `previous_response_id`, `conversation` and `background` are refused with a
400 (send the whole conversation as `input` items instead). Tool shapes go through
openai_tools.py, so a call is generated, read and identified exactly as on chat completions.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from backends.contract.tools import AnswerReader
from dispatcher.gateway.core import ApiError, JobUpdate, shown, unsupported
from dispatcher.gateway.openai_bodies import answers_in_json, sse_data
from dispatcher.gateway.openai_tools import function, invalid, tool_fields
from dispatcher.gateway.reasoning import BUDGET_FIELDS, budget_field, reasoning_fields

FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "stream",
    "store",
    "user",
    "metadata",
    "include",
    "truncation",
    "reasoning",
    *BUDGET_FIELDS,  # llama-server's thought budget, as in chat completions
}
STATELESS = {
    "previous_response_id": "responses are not stored here: send the whole conversation as input items",
    "conversation": "conversations are not stored here: send the whole conversation as input items",
    "background": "background responses need stored responses, which this gateway does not keep",
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


def job_request(body: dict[str, Any], thinks: bool = False) -> dict[str, Any]:
    """The fleet job's fields for a Responses body; 400 naming a field it cannot honour.
    `thinks`: the pool's model thinks (its thoughts become a reasoning item)."""
    for name in body:
        if name in STATELESS and body[name] not in (False, None):
            raise ApiError(
                400, f"'{name}' is not supported: {STATELESS[name]}", param=name, code="unsupported_field"
            )
        if name not in FIELDS and name not in STATELESS:
            raise unsupported(name, "OpenAI Responses")
    if body.get("include") or body.get("truncation") not in (None, "disabled"):
        raise unsupported("include" if body.get("include") else "truncation", "OpenAI Responses")
    if not isinstance(body.get("user", ""), str):  # accepted and unused, but typed as OpenAI's
        raise invalid("user", "'user' must be a string")
    fields: dict[str, Any] = {k: body[k] for k in ("temperature", "top_p") if k in body}
    if "max_output_tokens" in body:
        fields["max_tokens"] = body["max_output_tokens"]
    fields.update(_text_format(body.get("text")))
    fields.update(tool_fields(body, _tool, "function tools"))
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise invalid("reasoning", "'reasoning' must be {\"effort\": ..., \"summary\": ...}")
    fields.update(reasoning_fields(thinks, effort=reasoning.get("effort"), budget=budget_field(body)))
    messages = _input(body.get("input"))
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise invalid("instructions", "'instructions' must be a string")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    return {**fields, "messages": messages}


def _tool(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(
            where,
            f'{where} must be a function tool ({{"type": "function", "name": ...}}); '
            "only function tools are supported",
        )
    return function({k: v for k, v in tool.items() if k != "type"}, where)


def _text_format(text: object) -> dict[str, Any]:
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if (
        not isinstance(text, dict)
        or set(text) - {"format", "verbosity"}
        or (fmt is not None and kind is None)
    ):
        raise invalid("text", '\'text\' must be {"format": {"type": "text" | "json_object" | "json_schema"}}')
    if fmt is None or kind == "text":
        return {}
    if kind == "json_object":
        return {"format": "json"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"format": fmt["schema"]}
    raise invalid("text.format", "text.format must be text, json_object, or json_schema with a schema object")


def _input(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", "'input' must be a string or a non-empty list of items")
    # a tool's output answers a call of the same input (nothing is stored to find it elsewhere)
    called = {item.get("call_id") for item in value if isinstance(item, dict)
              and item.get("type") == "function_call" and isinstance(item.get("call_id"), str)}
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, given to the assistant turn after it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if not isinstance(item, dict):
            raise invalid(where, f"{where} must be an object")
        if kind == "reasoning":
            parts = [*(item.get("content") or []), *(item.get("summary") or [])]
            thought = _text([{**p, "type": "text"} for p in parts if isinstance(p, dict)], where)
            continue
        if kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "name": item.get("name"),
                "arguments": item.get("arguments", "{}"),
            }
            if not all(isinstance(v, str) for v in call.values()):
                raise invalid(where, f"{where} needs call_id, name and arguments (a JSON string)")
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # one answer's calls: one assistant message
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought is not None:
                    out[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str | list):
                raise invalid(where, f"{where} needs call_id and output (a string)")
            if item["call_id"] not in called:  # OpenAI's words
                raise invalid("input", f"No tool call found for function call output with call_id "
                              f"{shown(item['call_id'])}.")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(output, where)})
        elif kind == "message" and isinstance(item.get("role"), str) and item["role"] in ROLES:
            out.append({"role": ROLES[item["role"]], "content": _text(item.get("content"), where)})
            if thought is not None and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"], thought = thought, None
        else:
            raise unsupported(f"{where} (type {kind}, role {item.get('role')})", "OpenAI Responses")
    return out


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in TEXT_PARTS]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(str(t) for t in texts)
    raise unsupported(f"{where}.content (only text parts: input_text, output_text)", "OpenAI Responses")


# -- the job -> a Response -----------------------------------------------------------------------


class ResponseReply:
    """The Response object of one job, whole or as its stream of events."""

    def __init__(self, body: dict[str, Any], fields: dict[str, Any], job_id: str) -> None:
        self.job_id = job_id
        self.id = f"resp_{job_id}"
        self.created = int(time.time())
        self.tools = answers_in_json(fields)  # the job streams the answer JSON
        self.seq = 0
        self.echo = {
            "model": body["model"],
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {},
            "store": False,
            "previous_response_id": None,
            "truncation": "disabled",
        }

    def response(
        self, status: str, output: list[dict[str, Any]], result: dict[str, Any] | None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "output": output,
            **self.echo,
            "usage": None,
        }
        if result is not None:
            usage = result.get("usage") or {}
            prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
            out["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
            if result.get("finish_reason") == "length":
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return out

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The message item; `status`: in_progress (no part yet), completed or incomplete (cut)."""
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "type": "message",
            "id": f"msg_{self.job_id}",
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [part],
        }

    def call(self, call: dict[str, str], status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call['id'].removeprefix('call_')}",
            "call_id": call["id"],
            "name": call["name"],
            "arguments": call["arguments"] if status == "completed" else "",
            "status": status,
        }

    def thought(self, text: str, status: str) -> dict[str, Any]:
        """The reasoning item (an open model's thoughts are its content, as gpt-oss's)."""
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"type": "reasoning", "id": f"rs_{self.job_id}", "summary": [], "content": content,
                "status": status}

    def output(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        said = result.get("reasoning_content")
        thought = [self.thought(said, "completed")] if said else []
        if result.get("tool_calls"):  # complete calls, even when the answer was cut after them
            return [*thought, *(self.call(c, "completed") for c in result["tool_calls"])]
        text = result.get("content") if "tool_calls" in result else result.get("text", "")
        return [*thought, self.message(text or "", item_status(result))]

    def whole(self, final: JobUpdate) -> dict[str, Any]:
        if final.error is not None:
            raise ApiError(422, f"generation failed: {final.error}", code="job_failed")
        result = final.result or {}
        return self.response("completed", self.output(result), result)

    def failed(self, error: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The Response of a job that failed mid-stream (the event `response.failed` carries)."""
        out = self.response("failed", output, None)
        out["error"] = {"code": "server_error", "message": f"generation failed: {error}"}
        return out

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse_data({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    async def events(self, updates: AsyncIterator[JobUpdate]) -> AsyncIterator[str]:
        """response.created, .in_progress, then each output item as it comes (a message: its
        part and text deltas; a call: its arguments), then how it ended, as OpenAI ends it:
        response.completed, response.incomplete (cut by max_output_tokens: the message item is
        `incomplete` too) or response.failed (the job failed)."""
        yield self.event("response.created", response=self.response("in_progress", [], None))
        yield self.event("response.in_progress", response=self.response("in_progress", [], None))
        reader = AnswerReader(self.job_id) if self.tools else None
        text, message_open = "", False
        thinking: str | None = None  # the open reasoning item's text
        done: list[dict[str, Any]] = []  # the finished output items
        async for u in updates:
            if u.error is not None:
                cut = [self.message(text, "incomplete")] if message_open else []
                yield self.event("response.failed", response=self.failed(u.error, [*done, *cut]))
                return
            words, calls = reader.feed(u.delta) if reader is not None else (u.delta, [])
            more = reader.take_reasoning() if reader is not None else ""
            if more and thinking is None:
                yield self.event("response.output_item.added", output_index=len(done),
                                 item=self.thought("", "in_progress"))
            if more:
                thinking = (thinking or "") + more
                yield self.event("response.reasoning_text.delta", item_id=f"rs_{self.job_id}",
                                 output_index=len(done), content_index=0, delta=more)
            if thinking is not None and (words or calls or u.result is not None):
                for event in self._close_thought(thinking, len(done)):
                    yield event
                done.append(self.thought(thinking, "completed"))
                thinking = None
            if words and not message_open:
                message_open = True
                for event in self._open_message(len(done)):
                    yield event
            if words:
                text += words
                yield self.event(
                    "response.output_text.delta",
                    item_id=f"msg_{self.job_id}",
                    output_index=len(done),
                    content_index=0,
                    delta=words,
                    logprobs=[],
                )
            for call in calls:
                for event in self._call_events(call, len(done)):
                    yield event
                done.append(self.call(call, "completed"))
            if u.result is not None:
                if not done and not message_open:  # an empty answer is still one message
                    message_open = True
                    for event in self._open_message(0):
                        yield event
                status = item_status(u.result)
                if message_open:
                    for event in self._close_message(text, len(done), status):
                        yield event
                    done.append(self.message(text, status))
                ended = self.response("completed", done, u.result)
                yield self.event(f"response.{ended['status']}", response=ended)

    def _open_message(self, index: int) -> list[str]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event(
                "response.output_item.added", output_index=index, item=self.message("", "in_progress")
            ),
            self.event(
                "response.content_part.added",
                item_id=f"msg_{self.job_id}",
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _close_message(self, text: str, index: int, status: str) -> list[str]:
        item_id = f"msg_{self.job_id}"
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return [
            self.event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
            ),
            self.event("response.output_item.done", output_index=index, item=self.message(text, status)),
        ]

    def _close_thought(self, text: str, index: int) -> list[str]:
        return [
            self.event("response.reasoning_text.done", item_id=f"rs_{self.job_id}", output_index=index,
                       content_index=0, text=text),
            self.event("response.output_item.done", output_index=index,
                       item=self.thought(text, "completed")),
        ]

    def _call_events(self, call: dict[str, str], index: int) -> list[str]:
        item_id = self.call(call, "completed")["id"]
        return [
            self.event("response.output_item.added", output_index=index, item=self.call(call, "in_progress")),
            self.event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=index,
                delta=call["arguments"],
            ),
            self.event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                arguments=call["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=self.call(call, "completed")),
        ]


def item_status(result: dict[str, Any]) -> str:
    """A finished message item's status: `incomplete` when max_output_tokens cut it (as OpenAI's)."""
    return "incomplete" if result.get("finish_reason") == "length" else "completed"
