"""OpenAI's Responses API over the fleet, stateless: POST /v1/responses.

One request is one fleet job (bodies: responses_bodies.py); its stream is the SSE events the
Responses API documents, each with a `sequence_number`. Errors use OpenAI's error shape.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from dispatcher.gateway.core import Gateway
from dispatcher.gateway.openai_api import answer_one, check_limits, read_body, submit
from dispatcher.gateway.responses_bodies import ResponseReply, job_request


async def create_response(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_body(request)
    caller = request.state.caller
    pool = gw.pool_for(body.get("model"), caller)
    fields = job_request(body, thinks=pool in gw.thinking_pools)
    check_limits(gw, [fields], 1, tokens_field="max_output_tokens")
    jobs, headers = await submit(request, pool, [fields])
    return await answer_one(request, jobs, headers, ResponseReply(body, fields, jobs[0].id),
                            bool(body.get("stream")))
