"""What is loaded where, and loading or unloading it: Ollama's `/api/ps` and its load/unload
requests (an empty prompt loads, `keep_alive` 0 unloads), and llama-server's router endpoints
`GET /models`, `POST /models/load`, `POST /models/unload` (operators only).

A model of the catalogue (backends/contract/catalogue.py) is loaded where a worker's status lists
it (its `backend_stats.models`: RAM, expiry, context); a load is a small text job on its pool,
which the worker that claims it loads the model for (worker/claiming/models.py); an unload is a
mark (UNLOADED_KEY) that the workers holding the model act on within a second. A pool outside the
catalogue holds its model for its workers' lives: it is loaded while a worker lives, and an
unload only hides it from `/api/ps` until its next request.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backends.contract.catalogue import duration_seconds, live_copies
from backends.contract.keys import UNLOADED_KEY, model_copies_key, model_loading_key, worker_key
from backends.contract.text_ops import REJECTED, text_fields
from dispatcher.gateway.core import ApiError, Gateway, Served, shown
from dispatcher.gateway.ollama_show import UNKNOWN_DETAILS, listed_cards
from dispatcher.gateway.openai_api import read_body, run_one

EPOCH = "1970-01-01T00:00:00Z"
# Ollama's expires_at of a model kept loaded for good (keep_alive < 0: now + the longest Go
# duration, ~292 years; `ollama ps` shows "Forever")
FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)


def model_entry(name: str, card: dict[str, Any]) -> dict[str, Any]:
    """A model of /api/tags from its pool's card (the fields stay, empty, without one)."""
    return {"name": name, "model": name, "modified_at": str(card.get("modified_at") or EPOCH),
            "size": count(card.get("size")), "digest": str(card.get("digest") or ""),
            "details": {**UNKNOWN_DETAILS, **(card.get("details") or {})}}


def count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def listed(gw: Gateway, request: Request) -> list[Served]:
    """The caller's models, one per pool: an alias (another name in `gateway.models` for the same
    pool) is the same model, never a second entry whose workers' memory would count twice. Its
    first name is the one listed, the others follow as aliases."""
    names: dict[str, list[str]] = {}
    for m in gw.served_for(request.state.caller):
        names.setdefault(m.pool, []).extend(m.names)
    return sorted((Served(pool, tuple(dict.fromkeys(n))) for pool, n in names.items()), key=lambda m: m.name)


def iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


async def copies(gw: Gateway, pools: list[str]) -> tuple[set[str], dict[str, list[dict[str, Any]]]]:
    """The pools an operator unloaded, and per pool the copies of its model loaded now: for a
    catalogue model its holders' entries (model_copies_key: RAM, expiry, context), written as they
    load and unload; for another pool one per live worker ({"worker", "rss_mb"})."""
    async with gw.fleet.redis.pipeline(transaction=False) as pipe:
        pipe.hmget(UNLOADED_KEY, pools)
        for pool in pools:
            if pool in gw.catalogue_pools:
                pipe.hgetall(model_copies_key(pool))
            else:
                for name in gw.pool_members.get(pool, []):
                    pipe.hget(worker_key(name), "rss_mb")
        replies = await pipe.execute()
    unloaded = {pool for pool, mark in zip(pools, replies[0], strict=True) if mark is not None}
    answers = iter(replies[1:])
    held: dict[str, list[dict[str, Any]]] = {}
    for pool in pools:
        if pool in gw.catalogue_pools:
            live = live_copies(next(answers))
            held[pool] = [{"worker": name, **entry} for name, entry in sorted(live.items())]
        else:
            members = gw.pool_members.get(pool, [])
            held[pool] = [{"worker": name, "rss_mb": _json(next(answers))} for name in members]
    return unloaded, held


async def ps(request: Request) -> Response:
    """The caller's models loaded now (Ollama: in memory). A catalogue model: `size` is the RAM
    of its loaded copies, `expires_at` when the last one goes if idle; another pool's: its live
    workers' RSS, kept for good. `workers` (an addition) names where the copies are."""
    gw: Gateway = request.app.state.gateway
    running = [m for m in listed(gw, request) if gw.live_workers.get(m.pool)]
    pools = list(dict.fromkeys(m.pool for m in running))
    if not pools:
        return JSONResponse({"models": []})
    unloaded, held = await copies(gw, pools)
    cards = await listed_cards(gw, pools)
    forever = datetime.now(UTC) + FOREVER
    out = []
    for m in running:
        copies_of = held.get(m.pool, [])
        if not copies_of or (m.pool in unloaded and m.pool not in gw.catalogue_pools):
            continue
        if m.pool in gw.catalogue_pools:
            size = sum(int(c.get("memory_mb") or 0) for c in copies_of) * 2**20
            ends = [c.get("expires_at") for c in copies_of]
            ends = [float(e) if isinstance(e, int | float) else None for e in ends]
            last = max((e for e in ends if e is not None), default=0.0)
            expires = forever if None in ends else datetime.fromtimestamp(last, UTC)
            context = max(int(c.get("context_length") or 0) for c in copies_of)
        else:
            size = sum(_bytes(c.get("rss_mb")) for c in copies_of)
            expires, context = forever, count(cards[m.pool].get("context_length"))
        out.append({**model_entry(m.name, cards[m.pool]), "size": size, "expires_at": iso(expires),
                    "size_vram": 0, "context_length": context,
                    "workers": sorted({str(c["worker"]) for c in copies_of})})
    return JSONResponse({"models": out})


async def load(request: Request, pool: str) -> float:
    """Have a worker load the pool's model (a catalogue model; others are loaded while their
    workers live): a text job on its pool, answered once the model is loaded. Seconds it took."""
    started = time.monotonic()
    gw: Gateway = request.app.state.gateway
    await gw.set_unloaded(pool, False)
    if pool in gw.catalogue_pools:
        await run_one(request, pool, text_fields("tokenize", content="load"), REJECTED, "loading the model")
    return time.monotonic() - started


async def unload(request: Request, pool: str, model: object) -> None:
    """Mark the pool's model unloaded (403 unless the caller may unload: an operator)."""
    gw: Gateway = request.app.state.gateway
    if not gw.may_unload(request.state.caller):
        raise ApiError(403, f"model '{shown(model)}' is shared by this fleet's callers: unloading it "
                       "needs an operator's key (gateway.admin_keys)", code="admin_key_required")
    await gw.set_unloaded(pool, True)


def keep_alive_field(body: dict[str, Any], gw: Gateway, request: Request) -> dict[str, float]:
    """A request's `keep_alive` as the job's field (seconds, -1 for good): how long its model stays
    loaded once idle, from this request on. Only a caller who may unload sets it (a tenant shares
    the models: its hint is checked, then left out)."""
    if body.get("keep_alive") is None:
        return {}
    seconds = duration_seconds(body["keep_alive"])
    if seconds is None:
        raise ApiError(400, f"keep_alive must be a number of seconds or a duration such as \"5m\", not "
                       f"'{shown(body['keep_alive'])}'", param="keep_alive")
    return {"keep_alive": seconds} if gw.may_unload(request.state.caller) else {}


async def router_models(request: Request) -> Response:
    """llama-server's router listing: every model with its status (loaded, loading, unloaded)."""
    gw: Gateway = request.app.state.gateway
    models = listed(gw, request)
    pools = list(dict.fromkeys(m.pool for m in models))
    unloaded, held = await copies(gw, pools) if pools else (set(), {})
    async with gw.fleet.redis.pipeline(transaction=False) as pipe:
        for pool in pools:
            pipe.exists(model_loading_key(pool))
        loading = dict(zip(pools, await pipe.execute(), strict=True))
    data = []
    for m in models:
        state = ("loaded" if held.get(m.pool) and m.pool not in unloaded - gw.catalogue_pools
                 else "loading" if loading.get(m.pool) else "unloaded")
        data.append({"id": m.name, "object": "model", "owned_by": "llama-fleet", "created": 0,
                     "aliases": list(m.names[1:]), "status": {"value": state}})
    return JSONResponse({"object": "list", "data": data})


async def router_load(request: Request) -> Response:
    model, pool = await _named(request)
    await load(request, pool)
    return JSONResponse({"success": True, "model": model})


async def router_unload(request: Request) -> Response:
    model, pool = await _named(request)
    await unload(request, pool, model)
    return JSONResponse({"success": True, "model": model})


async def _named(request: Request) -> tuple[str, str]:
    """The router's body `{"model": ...}`: operators only; the model and its pool."""
    if not request.app.state.gateway.may_unload(request.state.caller):
        raise ApiError(403, "loading and unloading models needs an operator's key (gateway.admin_keys)",
                       code="admin_key_required")
    body = await read_body(request)
    model = body.get("model")
    pool = request.app.state.gateway.pool_for(model, request.state.caller)
    return str(model), pool


def _json(raw: object) -> Any:
    try:
        return json.loads(raw) if isinstance(raw, str | bytes) else None
    except ValueError:
        return None


def _bytes(mib: object) -> int:
    return int(mib * 2**20) if isinstance(mib, int | float) and not isinstance(mib, bool) and mib > 0 else 0
