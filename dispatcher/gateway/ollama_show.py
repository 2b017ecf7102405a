"""Ollama's POST /api/show: what a model is (Open WebUI and other front-ends ask for every model).

The gateway may run where the model file is not (a producer-only host), so the answer comes from
the model card a live worker of the model's pool publishes with its heartbeat
(backends/model_card.py, key `fleet:model:<worker>`, the status hash's TTL). With no live worker,
or an engine that cannot describe its model, the fields hold what the gateway knows: the name,
the format, "completion". Ollama's listings (/api/tags, /api/ps) read the same cards, one per pool
(`listed_cards`), remembering the last one seen of each pool.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backends.contract.keys import model_card_key
from backends.contract.retry import OUTAGE_ERRORS
from dispatcher.gateway.core import ApiError, Gateway, shown, unsupported
from dispatcher.gateway.openai_api import read_body

# `name`: older clients; `verbose`: also the vocabulary's arrays (llama.cpp keeps none: ignored)
FIELDS = ("model", "name", "verbose")
UNKNOWN_DETAILS = {"parent_model": "", "format": "gguf", "family": "", "families": None, "parameter_size": "",
                   "quantization_level": ""}


async def show(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_body(request)
    if refused := [name for name in body if name not in FIELDS]:
        raise unsupported(refused, "Ollama")
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: the name of a model this gateway serves", param="model")
    try:
        pool = gw.pool_for(model, request.state.caller)
    except ApiError as e:
        if e.status == 404:  # Ollama's words, which its clients show
            raise ApiError(404, f"model '{shown(model)}' not found") from None
        raise
    return JSONResponse(answer(await published_card(gw, pool)))


async def published_card(gw: Gateway, pool: str) -> dict[str, Any]:
    """The card a live worker of the pool publishes ({} when none does)."""
    try:
        for name in gw.pool_members.get(pool, []):
            raw = await gw.fleet.redis.get(model_card_key(name))
            if raw:
                card = json.loads(raw)
                if isinstance(card, dict):
                    gw.cards[pool] = card
                    return card
                return {}
    except OUTAGE_ERRORS:
        raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable") from None
    return gw.cards.get(pool, {})  # a catalogue model's, read from its file


async def listed_cards(gw: Gateway, pools: list[str]) -> dict[str, dict[str, Any]]:
    """Each pool's card for Ollama's listings, in one round trip: a live worker's, else the last
    one this gateway saw (a listing names the fleet's models whether a worker runs them now or
    not, as Ollama lists the models it has), else {}."""
    asked = [(pool, gw.pool_members[pool][0]) for pool in dict.fromkeys(pools) if gw.pool_members.get(pool)]
    if asked:
        async with gw.fleet.redis.pipeline(transaction=False) as pipe:
            for _, worker in asked:
                pipe.get(model_card_key(worker))
            replies = await pipe.execute()
        for (pool, _), raw in zip(asked, replies, strict=True):
            card = json.loads(raw) if raw else None
            if isinstance(card, dict):
                gw.cards[pool] = card
    return {pool: gw.cards.get(pool, {}) for pool in pools}


def answer(card: dict[str, Any]) -> dict[str, Any]:
    """Ollama's /api/show body from a card, each field Ollama has filled in."""
    return {
        "modelfile": card.get("modelfile", ""),
        "parameters": card.get("parameters", ""),
        "template": card.get("template", ""),
        "license": card.get("license", ""),
        "details": {**UNKNOWN_DETAILS, **(card.get("details") or {})},
        "model_info": card.get("model_info") or {},
        "capabilities": card.get("capabilities") or ["completion"],
        "modified_at": card.get("modified_at") or "1970-01-01T00:00:00Z",
    }
