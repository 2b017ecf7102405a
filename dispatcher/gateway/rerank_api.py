"""Rerank over the fleet: llama-server's and Jina's POST /v1/rerank (and /rerank), Cohere's POST
/v2/rerank.

A request is one rerank job (its documents scored together, sharing the query's prefix: see
backends/contract/rerank.py), queued, prioritised, admitted for its tenant and run by a worker
like any job (worker/serving/rerank_jobs.py). Results come sorted by `relevance_score`, highest
first (ties: by `index`), cut to `top_n`, each with its document when `return_documents` asks.
Bad input is a 400 naming it: at the gateway (fields, types, no documents, more than
gateway.rerank_max_documents), or from the worker (a document or query over its context,
backend.rerank_n_ctx).
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backends.contract.rerank import REJECTED, rerank_fields
from dispatcher.gateway.core import ApiError, Gateway, shown
from dispatcher.gateway.embeddings_api import refuse_unknown
from dispatcher.gateway.openai_api import read_body, run_one

# `instruction`: the task the model judges documents for (llama-fleet's; Qwen3-Reranker's "Instruct")
FIELDS = {"model", "query", "documents", "top_n", "return_documents", "instruction"}


async def jina_rerank(request: Request) -> Response:
    """llama-server's and Jina's shape: `results` and `usage` (documents returned by default, as
    Jina's API does)."""
    body = await read_body(request)
    ranked, result, headers = await rerank(request, body, return_default=True)
    tokens = int((result.get("usage") or {}).get("prompt_tokens") or 0)
    return JSONResponse({"object": "list", "model": body["model"], "results": ranked,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)


async def cohere_rerank(request: Request) -> Response:
    """Cohere's v2 shape: `id`, `results`, `meta` with the tokens and one billed search unit."""
    body = await read_body(request)
    ranked, result, headers = await rerank(request, body, return_default=False)
    tokens = int((result.get("usage") or {}).get("prompt_tokens") or 0)
    return JSONResponse({"id": str(uuid.uuid4()), "results": ranked,
                         "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                                  "tokens": {"input_tokens": tokens, "output_tokens": 0}}},
                        headers=headers)


async def rerank(request: Request, body: dict[str, Any], *,
                 return_default: bool) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, str]]:
    """Run the body as one rerank job: the ranked results, the job's result, the headers."""
    refuse_unknown(body, FIELDS, "rerank", route="rerank")
    gw: Gateway = request.app.state.gateway
    pool = gw.pool_for(body.get("model"), request.state.caller)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ApiError(400, "'query' is required: the text the documents are ranked for", param="query",
                       code="invalid_value")
    texts = document_texts(body.get("documents"), gw.settings.gateway.rerank_max_documents)
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise ApiError(400, f"'top_n' must be a positive integer, not '{shown(top_n)}'", param="top_n",
                       code="invalid_value")
    returned = body.get("return_documents", return_default)
    if not isinstance(returned, bool):
        raise ApiError(400, "'return_documents' must be true or false", param="return_documents",
                       code="invalid_value")
    fields = {"instruction": body["instruction"]} if "instruction" in body else {}
    result, headers = await run_one(request, pool, rerank_fields(query, texts, **fields), REJECTED,
                                    "rerank", param="documents")
    scores = result.get("scores") or []
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    ranked = [{"index": i, "relevance_score": scores[i],
               **({"document": {"text": texts[i]}} if returned else {})} for i in order]
    return ranked, result, headers


def document_texts(documents: object, limit: int) -> list[str]:
    """The documents' texts: each a string or an object with a `text` (Jina's and Cohere's v1
    form); 400 naming the first that is neither, or a count over `limit`."""
    if not isinstance(documents, list) or not documents:
        raise ApiError(400, "'documents' is required: a list of 1 or more strings (or objects with a "
                       "'text')", param="documents", code="invalid_value")
    if len(documents) > limit:
        raise ApiError(400, f"'documents' holds {len(documents):,} documents; this gateway ranks at most "
                       f"{limit:,} in one request (gateway.rerank_max_documents)", param="documents",
                       code="too_many_documents")
    texts = []
    for i, doc in enumerate(documents):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise ApiError(400, f"document {i} is neither a string nor an object with a 'text' string",
                           param="documents", code="invalid_value")
        texts.append(text)
    return texts
