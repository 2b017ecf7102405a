"""OpenAI's Responses API over the fleet, stateless: POST /v1/responses.

One request is one fleet job (bodies: responses_bodies.py); its stream is the SSE events the
Responses API documents, each with a `sequence_number`. Errors use OpenAI's error shape.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from dispatcher.gateway.core import Gateway
from dispatcher.gateway.openai_api import answer, check_limits, read_body
from dispatcher.gateway.responses_bodies import ResponseReply, job_request


async def create_response(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_body(request)
    caller = request.state.caller
    pool = gw.pool_for(body.get("model"), caller)
    fields = job_request(body)
    check_limits(gw, [fields], 1, tokens_field="max_output_tokens")
    jobs = await gw.submit(pool, [fields], request.headers.get("x-fleet-priority", "default"), caller)
    reply = ResponseReply(body, fields, jobs[0].id)
    headers = {"X-Fleet-Job-Id": jobs[0].id}
    timeout = gw.settings.gateway.request_timeout
    return await answer(request, jobs, timeout, headers, reply.events if body.get("stream") else None,
                        lambda finals: reply.whole(finals[0]))
