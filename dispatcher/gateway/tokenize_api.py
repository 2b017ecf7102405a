"""llama-server's tokenizer routes over the fleet: POST /tokenize, POST /detokenize and POST
/apply-template, with llama-server's bodies and answers (no /v1 aliases: llama-server has none).

The tokenizer and the chat template live with the model, in the workers, so each request is one
small text job (backends/contract/text_ops.py) that a worker of the pool answers between its
steps, queued, prioritised and admitted for its tenant like any job. llama-server serves one
model and its clients send none: without `model` the request goes to the one model the caller may
use, whatever names (aliases) it has (with several pools, `model` is required). Bad input is a
400 naming the field, at the gateway (a missing or mistyped field, a content over the limit) or
from the worker (an id outside the model's vocabulary, a text of too many tokens).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from backends.contract.text_ops import REJECTED, TOKENIZE_FIELDS, TextOp, text_fields
from dispatcher.gateway.core import ApiError, Gateway, unsupported
from dispatcher.gateway.openai_api import job_fields, read_body, run_one

API = "llama-server"


async def tokenize(request: Request) -> Response:
    body = await read_body(request)
    refuse_unknown(body, {"model", *TOKENIZE_FIELDS})
    content = required(body, "content", "the text to tokenize")
    if not isinstance(content, str):  # llama-server also takes a list of texts and token ids
        raise ApiError(400, "'content' must be a string", param="content", code="invalid_value")
    fields = {k: body[k] for k in TOKENIZE_FIELDS if k in body}
    return await answer(request, body, "tokenize", fields)


async def detokenize(request: Request) -> Response:
    body = await read_body(request)
    refuse_unknown(body, {"model", "tokens"})
    return await answer(request, body, "detokenize",
                        {"tokens": required(body, "tokens", "a list of token ids")})


async def apply_template(request: Request) -> Response:
    """The body of a chat completion (its other fields are read as the chat route reads them,
    so they shape the prompt the same way) -> `{"prompt": ...}`."""
    body = await read_body(request)
    chats, _ = job_fields(body, chat=True)
    return await answer(request, body, "apply_template", {"chat": chats[0]})


async def answer(request: Request, body: dict[str, Any], op: TextOp, fields: dict[str, Any]) -> Response:
    """Run the text job; its answer is llama-server's body, sent as the worker encoded it."""
    pool = pool_of(request, body.get("model"))
    result, headers = await run_one(request, pool, text_fields(op, **fields), REJECTED, op.replace("_", "-"))
    return Response(result.get("answer") or "{}", media_type="application/json", headers=headers)


def pool_of(request: Request, model: object) -> str:
    """The pool of `model`, or without one the caller's only model (llama-server's one model)."""
    gw: Gateway = request.app.state.gateway
    caller = request.state.caller
    if model is None and len(pools := {m.pool for m in gw.served_for(caller)}) == 1:
        return pools.pop()  # however many names (aliases) it has
    return gw.pool_for(model, caller)  # 400 without a model, 404 for one not the caller's


def required(body: dict[str, Any], name: str, what: str) -> Any:
    """llama-server answers an empty body without the field; here it is a 400 naming it."""
    if name not in body:
        raise ApiError(400, f"'{name}' is required: {what}", param=name, code="invalid_value")
    return body[name]


def refuse_unknown(body: dict[str, Any], allowed: set[str]) -> None:
    """llama-server ignores fields it does not know; here they are named (a typo would otherwise
    silently change the answer: `with_piece` for `with_pieces`)."""
    unknown = [name for name in body if name not in allowed]
    if unknown:
        raise unsupported(unknown, API)
