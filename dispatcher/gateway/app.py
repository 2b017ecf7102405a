"""The ASGI app of `fleet serve`: OpenAI's and Ollama's HTTP APIs over one AsyncFleet.

    app = create_app(load_serve_settings())      # or: uvicorn --factory dispatcher.gateway.app:app_from_env

GET /health is open (Redis reachable and at least one live worker); every other route needs a
bearer key when `gateway.api_keys` is set. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from dispatcher.gateway import batch_api, ollama_api, openai_api
from dispatcher.gateway.core import ApiError, Gateway
from dispatcher.gateway.settings import ServeSettings, load_serve_settings

log = logging.getLogger("fleet.gateway")
Handler = Callable[[Request], Awaitable[Response]]


def guarded(handler: Handler) -> Handler:
    """The handler, behind the API-key check (401 without a valid key)."""

    @functools.wraps(handler)
    async def check(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        if not gw.authorized(request.headers.get("authorization")):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


async def render_error(request: Request, exc: Exception) -> Response:
    """An ApiError in the shape of the API that was called."""
    assert isinstance(exc, ApiError)
    ollama = request.url.path.startswith("/api/")
    body = ollama_api.error_body(exc) if ollama else openai_api.error_body(exc)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    workers = sum(gw.live_workers.values())
    ok = gw.redis_up and workers > 0
    reason = None if ok else ("Redis unreachable" if not gw.redis_up else "no live worker")
    return JSONResponse({"status": "ok" if ok else "unavailable", "redis": gw.redis_up, "workers": workers,
                         "pools": gw.live_workers, "reason": reason}, status_code=200 if ok else 503)


def create_app(settings: ServeSettings) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway = Gateway(settings)
        await gateway.start()
        app.state.gateway = gateway
        try:
            yield
        finally:
            await gateway.stop()

    routes = [
        Route("/health", health),
        Route("/v1/models", guarded(openai_api.list_models)),
        Route("/v1/models/{model:path}", guarded(openai_api.get_model)),
        Route("/v1/chat/completions", guarded(openai_api.chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(openai_api.completions), methods=["POST"]),
        Route("/api/generate", guarded(ollama_api.generate), methods=["POST"]),
        Route("/api/chat", guarded(ollama_api.chat), methods=["POST"]),
        Route("/api/tags", guarded(ollama_api.tags)),
        Route("/api/ps", guarded(ollama_api.ps)),
        Route("/api/version", ollama_api.version),  # Ollama clients probe it before anything else
        *batch_api.routes(guarded),
        *observability_routes(settings),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={ApiError: render_error})


def observability_routes(settings: ServeSettings) -> list[Route | Mount]:
    """GET /metrics (Prometheus) and /dashboard, read with a sync client in Starlette's thread
    pool. With API keys set, both need a key too (the dashboard shows prompts)."""
    from backends.contract.connect import redis_from_url
    from dispatcher.observe.dashboard import dashboard_app
    from dispatcher.observe.metrics import metrics_route

    redis = redis_from_url(settings.redis_url)
    metrics = metrics_route(redis, settings.pool)
    dashboard = dashboard_app(redis, settings.pool)
    if settings.gateway.api_keys:
        metrics = Route("/metrics", guarded(metrics.endpoint))
        return [metrics, Mount("/dashboard", app=guarded_asgi(dashboard))]
    return [metrics, Mount("/dashboard", app=dashboard)]


def guarded_asgi(app: Starlette) -> Callable[..., Awaitable[None]]:
    """An ASGI app behind the same key check as the API routes."""

    async def check(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            request = Request(scope, receive)
            gw: Gateway = request.app.state.gateway
            if not gw.authorized(request.headers.get("authorization")):
                response = JSONResponse({"error": "Incorrect or missing API key"}, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await app(scope, receive, send)

    return check


def app_from_env() -> Starlette:
    """For uvicorn's --factory (and `fleet serve --workers N`): settings from FLEET_CONFIG and
    FLEET_* as `fleet serve` left them."""
    return create_app(load_serve_settings(os.environ.get("FLEET_CONFIG")))
