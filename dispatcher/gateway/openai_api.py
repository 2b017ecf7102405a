"""OpenAI's API over the fleet: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

A request becomes one fleet job per choice (`n`; with a list of prompts, n per prompt). `model`
names a pool. Streaming is SSE ending in `data: [DONE]`; errors use OpenAI's shape
{"error": {"message", "type", "param", "code"}}. A field this gateway cannot honour is a 400
naming it, never silently dropped (a null value counts as absent).

Logprobs come from the job's result, so a streamed choice carries them on its last chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dispatcher.aio import AsyncFleetJob
from dispatcher.gateway.core import (
    ApiError,
    Gateway,
    JobUpdate,
    cancel_all,
    field_named,
    ollama_route,
)
from dispatcher.gateway.following import collect, follow
from dispatcher.gateway.json_body import read_json_object
from dispatcher.gateway.openai_bodies import Reply, answers_in_json, error_body, job_fields, per_choice
from dispatcher.gateway.responses import JobStreamResponse, unless_client_leaves

__all__ = ["error_body", "job_fields"]  # request/response bodies live in openai_bodies.py


def model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llama-fleet"}


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    served = gw.models_for(request.state.caller)
    return JSONResponse({"object": "list", "data": [model_object(m) for m in sorted(served)]})


async def get_model(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    name = request.path_params["model"]
    gw.pool_for(name, request.state.caller)  # 404 when unknown, or not the caller's to use
    return JSONResponse(model_object(name))


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


# -- request -> jobs ------------------------------------------------------------------------------


async def read_body(request: Request) -> dict[str, Any]:
    """The JSON object of a request, null fields dropped (null counts as absent). Ollama's routes
    read it whatever the Content-Type says, as Ollama does: its own documented `curl -d` examples
    send application/x-www-form-urlencoded."""
    gw: Gateway = request.app.state.gateway
    body = await read_json_object(request, limit=gw.settings.gateway.max_body_bytes,
                                  max_depth=gw.settings.gateway.max_json_depth,
                                  any_media_type=ollama_route(request.url.path))
    return {k: v for k, v in body.items() if v is not None}


def check_limits(gw: Gateway, requests: list[dict[str, Any]], n: int, *,
                 tokens_field: str = "max_tokens") -> None:
    """The gateway's own bounds on what one request may cost (gateway.max_n, gateway.max_tokens);
    400 naming the limit."""
    limits = gw.settings.gateway
    if len(requests) * n > limits.max_n:
        raise ApiError(400, f"at most {limits.max_n} choices per request (prompts x n; gateway.max_n)",
                       param="n", code="invalid_value")
    for fields in requests:
        asked = fields.get("max_tokens")
        if isinstance(asked, int) and asked > limits.max_tokens:
            raise ApiError(400, f"{tokens_field} may be at most {limits.max_tokens} on this gateway "
                           "(gateway.max_tokens)", param=tokens_field, code="invalid_value")


def timed_out(finals: list[JobUpdate], headers: dict[str, str]) -> ApiError | None:
    """504 when gateway.request_timeout ended the wait (the jobs were cancelled; a retry starts
    afresh), naming the jobs like every answer."""
    late = next((u for u in finals if u.timed_out), None)
    if late is None:
        return None
    return ApiError(504, late.error or "timed out", code="timeout", headers=headers)


async def _complete(request: Request, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_body(request)
    caller = request.state.caller
    pool = gw.pool_for(body.get("model"), caller)
    requests, n = job_fields(body, chat, thinks=pool in gw.thinking_pools)
    check_limits(gw, requests, n)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):  # (unknown options are refused with the other fields)
        raise ApiError(400, "'stream_options' must be an object", param="stream_options",
                       code="invalid_value")
    jobs, headers = await submit(request, pool, per_choice(requests, n))
    reply = Reply(chat, body["model"], [j.id for j in jobs], bool(stream_options.get("include_usage")),
                  tools=answers_in_json(requests[0]))
    timeout = gw.settings.gateway.request_timeout
    return await answer(request, jobs, timeout, headers, reply.sse if body.get("stream") else None,
                        reply.whole)


async def submit(request: Request, pool: str,
                 requests: list[dict[str, Any]]) -> tuple[list[AsyncFleetJob], dict[str, str]]:
    """The request's jobs, submitted for its caller at its X-Fleet-Priority, and the headers for
    every answer (errors included): the one that names them, and a soft budget's marks."""
    gw: Gateway = request.app.state.gateway
    priority = request.headers.get("x-fleet-priority", "default")
    jobs, marks = await gw.submit(pool, requests, priority, request.state.caller)
    return jobs, {"X-Fleet-Job-Id": ",".join(j.id for j in jobs), **marks}


class OneJobReply(Protocol):
    """A dialect's answer to one job (Responses, Anthropic Messages)."""

    def events(self, updates: AsyncIterator[JobUpdate]) -> AsyncIterator[str]: ...

    def whole(self, final: JobUpdate) -> dict[str, Any]: ...


async def answer_one(request: Request, jobs: list[AsyncFleetJob], headers: dict[str, str],
                     reply: OneJobReply, stream: bool) -> Response:
    """One job's answer: `reply`'s events, or its whole body once the job ended (see answer)."""
    gw: Gateway = request.app.state.gateway
    return await answer(request, jobs, gw.settings.gateway.request_timeout, headers,
                        reply.events if stream else None, lambda finals: reply.whole(finals[0]))


async def answer(request: Request, jobs: list[AsyncFleetJob], timeout: float, headers: dict[str, str],
                 stream: Callable[[AsyncIterator[JobUpdate]], AsyncIterator[str]] | None,
                 whole: Callable[[list[JobUpdate]], dict[str, Any]]) -> Response:
    """The jobs' answer: an SSE stream of `stream`'s events (the jobs cancelled if the client
    leaves), or, once every job ended, `whole` of their final updates as JSON (504 past the
    timeout; a failed job's 422 still names the jobs)."""
    if stream is not None:
        return JobStreamResponse(stream(follow(jobs, timeout)), media_type="text/event-stream",
                                 on_disconnect=lambda: cancel_all(jobs),
                                 headers={**headers, "Cache-Control": "no-cache"})
    finals = await unless_client_leaves(request, collect(jobs, timeout), lambda: cancel_all(jobs))
    if finals is None:
        return Response(status_code=499)  # the client left; nobody reads this
    if late := timed_out(finals, headers):
        raise late
    try:
        body = whole(finals)
    except ApiError as e:  # a failed job: 422, still naming the jobs
        e.headers.update(headers)
        raise
    return JSONResponse(body, headers=headers)


async def run_one(request: Request, pool: str, fields: dict[str, Any], rejected: str, what: str, *,
                  param: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Run one job of `fields` to its end (embeddings, text jobs): its result and the response
    headers. 400 for a worker's failure starting with `rejected` (naming `param`, else the field
    its reason starts with), 422 for another failure, 504 past gateway.request_timeout."""
    gw: Gateway = request.app.state.gateway
    jobs, headers = await submit(request, pool, [fields])
    finals = await unless_client_leaves(request, collect(jobs, gw.settings.gateway.request_timeout),
                                        lambda: cancel_all(jobs))
    if finals is None:
        raise ApiError(499, "the client left", headers=headers)  # nobody reads this
    if late := timed_out(finals, headers):
        raise late
    error = finals[0].error
    if error is not None:
        if error.startswith(rejected):
            reason = error.removeprefix(rejected)
            raise ApiError(400, reason, param=param or field_named(reason), code="invalid_request",
                           headers=headers)
        raise ApiError(422, f"{what} failed: {error}", code="job_failed", headers=headers)
    return finals[0].result or {}, headers
