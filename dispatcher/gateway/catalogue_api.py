"""Changing the catalogue live, as Ollama's API does on one host: `POST /api/pull`, `POST
/api/copy`, `DELETE /api/delete` (operators only). The change goes to the live catalogue in Redis
(backends/contract/keys.py CATALOGUE_KEY): this gateway serves it at once, the other gateways and
the workers within a second, none restarted.

A pull names a catalogue model (a `url` entry: the config's or one added before), or adds one
with `url` and `sha256` (and optionally `n_ctx_per_seq`, `slots`, `keep_alive`, `embedding`,
`memory_mb`), then has a worker load it (a small job on its pool, as Ollama's preload): the
worker that takes it fetches the file into its host's cache first (backends/fetch.py), and the
pull streams that fetch's progress in Ollama's NDJSON (`status`, `digest`, `total`, `completed`),
or with `stream: false` answers once, `{"status": "success"}`. Other hosts fetch the file on
their first need of it. A failed fetch (a wrong sha256, no disk space, the server gone) is the
pull's error, named.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from backends.contract.catalogue import ModelEntry, model_pools
from backends.contract.keys import model_fetch_key
from dispatcher.gateway.core import ApiError, Gateway, shown
from dispatcher.gateway.models_api import load
from dispatcher.gateway.openai_api import read_body

PULL_OPTIONS = ("url", "sha256", "n_ctx_per_seq", "slots", "keep_alive", "embedding", "memory_mb")
PROGRESS_EVERY = 0.25  # seconds between reads of the fetch's progress
NAME_LIMIT = 200
SEEN_WAIT = 5.0  # seconds a change waits for a live worker to serve it


def _operator(request: Request, what: str) -> Gateway:
    gw: Gateway = request.app.state.gateway
    if not gw.may_unload(request.state.caller):
        raise ApiError(403, f"{what} needs an operator's key (gateway.admin_keys)", code="admin_key_required")
    return gw


def _name(body: dict[str, Any], *fields: str) -> str:
    """The model name a body gives in the first of `fields` it has (Ollama accepts `model` or
    `name`); 400 when none is a usable one."""
    value = next((body[f] for f in fields if f in body), None)
    if not isinstance(value, str) or not value.strip() or len(value) > NAME_LIMIT:
        raise ApiError(400, f"'{fields[0]}' must be a model name (1 to {NAME_LIMIT} characters)",
                       param=fields[0])
    return value


def _known(gw: Gateway, name: str) -> ModelEntry:
    entry = gw.live_catalogue.get(name)
    if entry is None:
        raise ApiError(404, f"model '{shown(name)}' is not in the catalogue", param="model",
                       code="model_not_found")
    return entry


async def _store(gw: Gateway, name: str, entry: ModelEntry) -> None:
    """Add or replace `name`: 400 when its pool is another model's. Answered once a live worker
    serves the model (the workers read the change within a second, their status says it at
    their next beat), or after SEEN_WAIT with none: a fleet scaled to zero serves it later."""
    try:
        model_pools({**{n: e for n, e in gw.live_catalogue.items() if n != name}, name: entry})
    except ValueError as e:
        raise ApiError(400, str(e), param="model") from None
    await gw.change_catalogue(name, entry)
    pool, until = entry.pool_of(name), time.monotonic() + SEEN_WAIT
    while gw.live_workers and not gw.live_workers.get(pool) and time.monotonic() < until:
        await asyncio.sleep(PROGRESS_EVERY)
        await gw.refresh()


async def pull(request: Request) -> Response:
    gw = _operator(request, "pulling a model")
    body = await read_body(request)
    name = _name(body, "model", "name")
    given = {k: body[k] for k in PULL_OPTIONS if k in body}
    if given:
        try:
            entry = ModelEntry.model_validate(
                {**given, "path": gw.settings.models_dir() / f"{given.get('sha256')}.gguf"})
        except ValidationError as e:
            problem = e.errors()[0]
            where = ".".join(map(str, problem["loc"])) or "url"
            raise ApiError(400, f"{where}: {problem['msg']}", param=where) from None
        if entry.url is None:
            raise ApiError(400, "a pulled model's options come with its `url` and `sha256`", param="url")
        await _store(gw, name, entry)
    else:
        entry = _known(gw, name)
    pool = entry.pool_of(name)
    digest = f"sha256:{entry.sha256}" if entry.sha256 else ""
    if body.get("stream") is False:
        await load(request, pool)
        return JSONResponse({"status": "success"})
    return StreamingResponse(_progress(request, gw, pool, digest), media_type="application/x-ndjson")


async def _progress(request: Request, gw: Gateway, pool: str, digest: str) -> AsyncIterator[str]:
    """Ollama's pull lines while a worker fetches and loads the model; an `error` line if it fails."""
    yield _line({"status": "pulling manifest"})
    loading = asyncio.create_task(load(request, pool))
    said: tuple[int, int] | None = None
    try:
        while True:
            done, _ = await asyncio.wait({loading}, timeout=PROGRESS_EVERY)
            raw = await gw.fleet.redis.hmget(model_fetch_key(pool), ["completed", "total"])
            completed, total = raw
            if completed is not None and total is not None:
                now = int(completed), int(total)
                if now != said:
                    said = now
                    yield _line({"status": f"pulling {digest.removeprefix('sha256:')[:12]}", "digest": digest,
                                 "total": now[1], "completed": now[0]})
            if done:
                break
        loading.result()
    except ApiError as e:
        yield _line({"error": e.message})
        return
    finally:
        if not loading.done():  # the client left: its load job is cancelled with the request
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await loading
    for status in ("verifying sha256 digest", "writing manifest", "success"):
        yield _line({"status": status})


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj) + "\n"


async def delete(request: Request) -> Response:
    gw = _operator(request, "deleting a model")
    name = _name(await read_body(request), "model", "name")
    _known(gw, name)
    await gw.change_catalogue(name, None)
    return Response(status_code=200)


async def copy(request: Request) -> Response:
    gw = _operator(request, "copying a model")
    body = await read_body(request)
    source, destination = _name(body, "source"), _name(body, "destination")
    entry = _known(gw, source)
    # the copy is a model of its own, in a pool of its own; its file is the source's
    await _store(gw, destination, entry.model_copy(update={"pool": None}))
    return Response(status_code=200)
