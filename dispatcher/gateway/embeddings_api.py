"""Embeddings over the fleet: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and its
legacy POST /api/embeddings.

A request is one embedding job (up to 2048 inputs), queued, prioritised, admitted for its tenant
and run by a worker like any job (worker/serving/embed_jobs.py). Vectors come back L2-normalised (legacy
/api/embeddings: as pooled, as Ollama's), cut to `dimensions` when asked. Bad input is a 400
naming it: at the gateway (fields, types, empty or too many inputs), or from the worker (an
input longer than its embedding context, `dimensions` over the model's size).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backends.contract.embed import REJECTED, decode_vector, embed_fields
from dispatcher.gateway.core import ApiError, Gateway, shown
from dispatcher.gateway.ollama_api import LOAD_OPTIONS
from dispatcher.gateway.openai_api import read_body, run_one

OPENAI_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
OLLAMA_FIELDS = {"model", "input", "truncate", "dimensions", "options", "keep_alive"}
LEGACY_FIELDS = {"model", "prompt", "options", "keep_alive"}


async def openai_embeddings(request: Request) -> Response:
    body = await read_body(request)
    refuse_unknown(body, OPENAI_FIELDS, "OpenAI")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be 'float' or 'base64', not '{shown(encoding)}'",
                       param="encoding_format", code="invalid_value")
    if not isinstance(body.get("user", ""), str):
        raise ApiError(400, "'user' must be a string", param="user", code="invalid_value")
    result, headers = await embed(request, body, truncate=False)
    vectors = result.get("embeddings") or []
    data = [{"object": "embedding", "index": i, "embedding": v if encoding == "base64" else decode_vector(v)}
            for i, v in enumerate(vectors)]
    tokens = int((result.get("usage") or {}).get("prompt_tokens") or 0)
    return JSONResponse({"object": "list", "data": data, "model": body["model"],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)


async def ollama_embed(request: Request) -> Response:
    started = time.monotonic_ns()
    body = await read_body(request)
    refuse_unknown(body, OLLAMA_FIELDS, "Ollama")
    check_options(body)
    truncate = body.get("truncate", True)  # Ollama cuts an input to its context by default
    if not isinstance(truncate, bool):
        raise ApiError(400, "'truncate' must be true or false", param="truncate", code="invalid_value")
    result, headers = await embed(request, body, truncate=truncate)
    return JSONResponse({"model": body["model"],
                         "embeddings": [decode_vector(v) for v in result.get("embeddings") or []],
                         "total_duration": time.monotonic_ns() - started, "load_duration": 0,
                         "prompt_eval_count": int((result.get("usage") or {}).get("prompt_tokens") or 0)},
                        headers=headers)


async def ollama_embeddings(request: Request) -> Response:
    """The legacy route: one `prompt`, one `embedding`, not normalised (as Ollama's)."""
    body = await read_body(request)
    refuse_unknown(body, LEGACY_FIELDS, "Ollama")
    check_options(body)
    prompt = body.pop("prompt", None)
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' is required: the text to embed", param="prompt", code="invalid_value")
    result, headers = await embed(request, {**body, "input": prompt}, truncate=True, normalize=False)
    vectors = result.get("embeddings") or []
    return JSONResponse({"embedding": decode_vector(vectors[0]) if vectors else []}, headers=headers)


async def embed(request: Request, body: dict[str, Any],
                **fields: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """Run the body's `input` as one embedding job: its result and the response headers. 400 for
    a bad request (the fleet's validation, or the worker's rejection), 422 for another failure,
    504 past gateway.request_timeout."""
    gw: Gateway = request.app.state.gateway
    caller = request.state.caller
    pool = gw.pool_for(body.get("model"), caller)
    if "dimensions" in body:
        fields["dimensions"] = body["dimensions"]
    if "input" not in body:
        raise ApiError(400, "'input' is required: a string or a list of strings", param="input",
                       code="invalid_value")
    return await run_one(request, pool, embed_fields(body["input"], **fields), REJECTED, "embedding",
                         param="input")


def refuse_unknown(body: dict[str, Any], allowed: set[str], api: str, route: str = "embeddings") -> None:
    """400 naming every field this route does not take (a null one counts as absent)."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        names = ", ".join(f"'{shown(f)}'" for f in unknown)
        raise ApiError(400, f"{names} {'is' if len(unknown) == 1 else 'are'} not supported by this {api} "
                       f"{route} route (llama-fleet)", param=unknown[0], code="unsupported_parameter")


def check_options(body: dict[str, Any]) -> None:
    """Ollama's `options`: how Ollama loads a model (num_ctx, ...) is the workers' business, so
    those are ignored; nothing else applies to an embedding."""
    options = body.get("options", {})
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object", param="options", code="invalid_value")
    other = sorted(set(options) - LOAD_OPTIONS)
    if other:
        raise ApiError(400, f"option '{shown(other[0])}' does not apply to embeddings", param="options",
                       code="invalid_value")
