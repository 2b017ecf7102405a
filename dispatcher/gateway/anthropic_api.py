"""Anthropic's Messages API over the fleet, as llama-server and Ollama serve it: POST /v1/messages
and POST /v1/messages/count_tokens.

One request is one fleet job (bodies: anthropic_bodies.py); its stream is Anthropic's SSE events.
Errors use Anthropic's shape. The key may come as `x-api-key` (the anthropic SDKs) or as
`Authorization: Bearer` (app.guarded); `anthropic-version` and `anthropic-beta` are accepted and
change nothing.

count_tokens needs the model's tokenizer, which only a worker has: the request's prompt runs as
a job of one greedy token, and the answer is the prompt tokens the worker counted, the same
count a Messages request with that prompt is billed (its input_tokens + cache_read_input_tokens).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from dispatcher.gateway.anthropic_bodies import MessageReply, count_request, error_body, job_request
from dispatcher.gateway.core import ApiError, Gateway, JobUpdate
from dispatcher.gateway.openai_api import answer, answer_one, check_limits, read_body, submit

__all__ = ["count_tokens", "create_message", "error_body"]


async def create_message(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_body(request)
    caller = request.state.caller
    pool = gw.pool_for(body.get("model"), caller)
    fields = job_request(body, thinks=pool in gw.thinking_pools)
    check_limits(gw, [fields], 1)
    jobs, headers = await submit(request, pool, [fields])
    return await answer_one(request, jobs, headers, MessageReply(body, fields, jobs[0].id),
                            bool(body.get("stream")))


async def count_tokens(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_body(request)
    pool = gw.pool_for(body.get("model"), request.state.caller)
    fields = count_request(body, thinks=pool in gw.thinking_pools)
    jobs, headers = await submit(request, pool, [fields])
    return await answer(request, jobs, gw.settings.gateway.request_timeout, headers, None, counted)


def counted(finals: list[JobUpdate]) -> dict[str, int]:
    final = finals[0]
    if final.error is not None:
        raise ApiError(422, f"counting failed: {final.error}", code="job_failed")
    return {"input_tokens": ((final.result or {}).get("usage") or {}).get("prompt_tokens", 0)}
