"""The ASGI app of `fleet serve`: OpenAI's, Anthropic's and Ollama's HTTP APIs over one AsyncFleet.

    app = create_app(load_serve_settings())      # or: uvicorn --factory dispatcher.gateway.app:app_from_env

Every route reaches Redis through that AsyncFleet's one async client and its bounded connection
pool: jobs and their streams, batches and files (batch_api.py), /metrics and /dashboard.

GET /health is open (Redis reachable and at least one live worker); every other route needs a
key when `gateway.api_keys` is set, as `Authorization: Bearer <key>` or `x-api-key: <key>` (the
anthropic SDKs' header). Keys are compared in constant time and never logged.

Every response carries an `x-request-id` (`RequestId`, outermost: errors, streams, the
dashboard and Starlette's own 500s too): the client's own when it sent a sane one, else a new
one. Every request passes `RequestGuard` next: cross-site browser requests may not POST or DELETE
(keys are off by default, so any web page the operator opens could otherwise run jobs), and a
body is bounded in size and in time while it is read (docs/gateway.md, "What the gateway refuses").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis as AsyncRedis
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backends.contract.catalogue import shown_pool
from backends.contract.gateway_settings import GatewaySettings
from backends.contract.retry import OUTAGE_ERRORS
from dispatcher.gateway import (
    anthropic_api,
    batch_api,
    catalogue_api,
    embeddings_api,
    models_api,
    ollama_api,
    ollama_show,
    openai_api,
    rerank_api,
    responses_api,
    tokenize_api,
)
from dispatcher.gateway.anthropic_bodies import anthropic_route
from dispatcher.gateway.core import ApiError, Gateway, caller_keys, ollama_route, shown
from dispatcher.gateway.responses import AsciiJSONResponse
from dispatcher.gateway.settings import ServeSettings, load_serve_settings

log = logging.getLogger("fleet.gateway")
Handler = Callable[[Request], Awaitable[Response]]


def guarded(handler: Handler) -> Handler:
    """The handler, behind the API-key check (401 without a valid key)."""

    @functools.wraps(handler)
    async def check(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        caller = gw.identify(request.headers.get("authorization"), request.headers.get("x-api-key"))
        if caller is None:
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' or "
                           "'x-api-key: <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        request.state.caller = caller
        return await handler(request)

    return check


def error_response(path: str, exc: ApiError) -> Response:
    """An ApiError in the shape of the API that was called, in ASCII JSON (it may echo any text)."""
    if ollama_route(path):
        body = ollama_api.error_body(exc)
    elif anthropic_route(path):
        body = anthropic_api.error_body(exc)
    else:
        body = openai_api.error_body(exc)
    return AsciiJSONResponse(body, status_code=exc.status, headers=exc.headers)


async def render_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request.url.path, exc)


async def render_outage(request: Request, exc: Exception) -> Response:
    """Redis away under a route that does not say so itself (files, batches, listings): the same
    503 the job routes answer, never a 500; the pool's idle connections go, dead after a restart."""
    log.warning("%s %s: Redis unreachable: %s", request.method, request.url.path, exc)
    gateway = getattr(request.app.state, "gateway", None)
    if isinstance(gateway, Gateway):
        await gateway.drop_idle_connections()
    return error_response(request.url.path, ApiError(503, "the fleet's Redis is unreachable",
                                                     code="redis_unavailable", headers={"Retry-After": "1"}))


# -- the request id on every response ---------------------------------------------------------------

REQUEST_ID = b"x-request-id"
ANTHROPIC_REQUEST_ID = b"request-id"  # what the anthropic SDKs read (`_request_id`, an error's request_id)
SANE_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces, bounded


class RequestId:
    """ASGI middleware: adds `x-request-id` to the response head: the client's, when it sent a
    sane one (1-128 printable ASCII characters, no spaces), else `req_` + 32 hex digits; on
    Anthropic's routes as `request-id` too, the header Anthropic's API answers with. Also in
    `scope["state"]["request_id"]` for the handlers. It touches only the response's start
    message, so a stream's chunks cost nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id.decode()
        names = (REQUEST_ID, ANTHROPIC_REQUEST_ID) if anthropic_route(scope["path"]) else (REQUEST_ID,)

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() not in names]
                message = {**message, "headers": [*headers, *((name, request_id) for name in names)]}
            await send(message)

        await self.app(scope, receive, with_id)


def request_id_of(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if name == REQUEST_ID:  # ASGI servers give header names in lower case
            return value if SANE_REQUEST_ID.fullmatch(value) else new_request_id()
    return new_request_id()


def new_request_id() -> bytes:
    return b"req_" + uuid.uuid4().hex.encode()


class GatewayApp(Starlette):
    """Starlette with `RequestId` outside its whole stack: user middleware runs inside
    Starlette's ServerErrorMiddleware, whose 500s would otherwise carry no id."""

    def build_middleware_stack(self) -> ASGIApp:
        return RequestId(super().build_middleware_stack())


# -- the guard in front of every route --------------------------------------------------------------

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
UPLOAD_ROUTE = "/v1/files"  # POST: multipart, with its own (larger) body limit
BODY_GRACE = 5.0  # seconds a body may take before gateway.body_min_rate applies
CLOSE = {"Connection": "close"}  # past what a 413 drains, a refused body is not read: the connection ends
# After a 413 the rest of the body is read (and thrown away) up to this many times the limit
# before the connection closes: clients (http.client, requests, httpx, the openai SDK) send the
# whole body before they read an answer, and a connection closed on unread bytes is reset, so
# they would see a broken pipe or a reset instead of the 413
DRAIN_FACTOR = 4


class RequestGuard:
    """ASGI middleware: refuses cross-site browser requests on mutating routes (403), bodies over
    the route's size limit (413: at once when Content-Length says so, else as soon as the bytes
    read pass it, chunked or not; the connection lingers while the rest of the body is drained)
    and bodies that arrive too slowly (408)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app = app
        self.settings = settings
        self.trusted = {o.rstrip("/").lower() for o in settings.trusted_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        upload = scope["method"] == "POST" and scope["path"] == UPLOAD_ROUTE
        limit = self.settings.max_upload_bytes if upload else self.settings.max_body_bytes
        meter = BodyMeter(receive, limit, upload, self.settings, headers)
        started = lingers = False

        async def sending(message: Message) -> None:
            nonlocal started, lingers
            if message["type"] == "http.response.start":
                started, lingers = True, message["status"] == 413
            elif lingers and not message.get("more_body", False):
                # the whole 413 goes out now (a client that reads while it sends stops at once);
                # the response ends, and the connection with it, once the body is drained
                await send({**message, "more_body": True})
                await meter.drain()
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        try:
            if scope["method"] in MUTATING:
                self.refuse_cross_site(scope, headers)
            if upload:
                refuse_non_multipart(headers)
            announced = headers.get("content-length", "")
            if announced.isdigit() and int(announced) > limit:
                raise too_large(limit, upload)
        except ApiError as refused:
            await error_response(scope["path"], refused)(scope, receive, sending)
            return
        try:
            await self.app(scope, meter.receive, sending)
        except ApiError as refused:  # raised by the meter where no route handler caught it
            if started:
                raise
            await error_response(scope["path"], refused)(scope, receive, sending)

    def refuse_cross_site(self, scope: Scope, headers: Headers) -> None:
        """403 for a browser request from another site: browsers send Sec-Fetch-Site and Origin,
        and a page cannot forge either; SDKs and curl send neither and pass."""
        origin = headers.get("origin")
        if origin is not None and origin.rstrip("/").lower() in self.trusted:
            return
        site = headers.get("sec-fetch-site")
        if site is not None and site.lower() not in ("same-origin", "none"):
            raise ApiError(403, f"cross-site request refused (Sec-Fetch-Site: {shown(site)}): a web page "
                           "from another site may not send requests that run or change work here "
                           "(gateway.trusted_origins lists origins that may)", code="cross_site_request")
        if origin is not None and not same_origin(origin, headers.get("host"), scope.get("scheme", "http")):
            raise ApiError(403, f"cross-origin request refused: Origin '{shown(origin)}' is not this gateway "
                           f"(Host '{shown(headers.get('host') or '')}'); gateway.trusted_origins lists "
                           "origins that may send requests", code="cross_site_request")


def same_origin(origin: str, host: str | None, scheme: str) -> bool:
    """Whether `origin` (scheme://host[:port]) names the host:port the request was sent to. A Host
    without a port counts as the origin's default port, so a TLS proxy in front changes nothing."""
    if not host or origin == "null":
        return False
    try:
        theirs, ours = urlsplit(origin), urlsplit(f"//{host}")
        default = {"http": 80, "https": 443}.get(theirs.scheme or scheme, 80)
        return ((theirs.hostname or "") == (ours.hostname or "")
                and (theirs.port or default) == (ours.port or default))
    except ValueError:  # a port that is not a number
        return False


def refuse_non_multipart(headers: Headers) -> None:
    ctype = headers.get("content-type", "")
    if ctype.partition(";")[0].strip().lower() != "multipart/form-data":
        got = f"'{shown(ctype)}'" if ctype else "none"
        raise ApiError(415, f"POST {UPLOAD_ROUTE} takes Content-Type multipart/form-data; got {got}",
                       code="unsupported_media_type")


def too_large(limit: int, upload: bool) -> ApiError:
    setting = "gateway.max_upload_bytes" if upload else "gateway.max_body_bytes"
    return ApiError(413, f"the request body is larger than {limit:,} bytes ({setting})",
                    code="body_too_large", headers=CLOSE)


class BodyMeter:
    """The `receive` a route reads its body through: counts bytes against the limit and bounds
    the time the body takes (uvicorn has no body timeout). Once the body is in, it only passes
    messages on (the disconnect watchers wait on it for as long as a response lasts)."""

    def __init__(self, receive: Receive, limit: int, upload: bool, settings: GatewaySettings,
                 headers: Headers) -> None:
        self._receive = receive
        self.limit = limit
        self.upload = upload
        self.timeout = settings.body_timeout
        self.min_rate = settings.body_min_rate
        self.started = time.monotonic()
        self.received = 0
        self.done = False
        announced = headers.get("content-length", "")
        # what a 413 drains: nothing of a body announced larger than the drain would take anyway
        self.drainable = DRAIN_FACTOR * limit
        if announced.isdigit() and int(announced) > self.drainable:
            self.drainable = 0

    async def drain(self) -> None:
        """Read and drop what is left of a refused body, up to `drainable` bytes in all and
        within the body's own time bounds, until the client has sent it all or leaves."""
        while not self.done and self.received < self.drainable:
            try:
                async with asyncio.timeout(self.deadline() - time.monotonic()):
                    message = await self._receive()
            except TimeoutError:
                return
            self.received += len(message.get("body", b""))
            self.done = message["type"] != "http.request" or not message.get("more_body", False)

    def deadline(self) -> float:
        """When the body must be further along: gateway.body_timeout after the head, and never
        slower on average than gateway.body_min_rate once BODY_GRACE has passed."""
        end = self.started + self.timeout
        if self.min_rate:
            end = min(end, self.started + max(BODY_GRACE, self.received / self.min_rate))
        return end

    async def receive(self) -> Message:
        if self.done:
            return await self._receive()
        try:
            async with asyncio.timeout(self.deadline() - time.monotonic()):
                message = await self._receive()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive in time ({self.received:,} bytes after "
                           f"{time.monotonic() - self.started:.1f}s; gateway.body_timeout is "
                           f"{self.timeout:g}s, gateway.body_min_rate {self.min_rate} bytes/s)",
                           code="body_timeout", headers=CLOSE) from None
        if message["type"] != "http.request":
            self.done = True
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.limit:
            raise too_large(self.limit, self.upload)
        self.done = not message.get("more_body", False)
        return message


async def health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    workers = sum(gw.live_workers.values())
    # models that scale from zero: a request starts their workers, so none running is no failure
    ok = gw.redis_up and (workers > 0 or any(gw.cold_start(pool) for pool in gw.catalogue_pools))
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
        Route("/v1/responses", guarded(responses_api.create_response), methods=["POST"]),
        Route("/v1/messages", guarded(anthropic_api.create_message), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(anthropic_api.count_tokens), methods=["POST"]),
        Route("/v1/embeddings", guarded(embeddings_api.openai_embeddings), methods=["POST"]),
        Route("/v1/rerank", guarded(rerank_api.jina_rerank), methods=["POST"]),
        Route("/rerank", guarded(rerank_api.jina_rerank), methods=["POST"]),  # llama-server's
        Route("/v2/rerank", guarded(rerank_api.cohere_rerank), methods=["POST"]),  # Cohere's
        Route("/api/generate", guarded(ollama_api.generate), methods=["POST"]),
        Route("/api/chat", guarded(ollama_api.chat), methods=["POST"]),
        Route("/api/embed", guarded(embeddings_api.ollama_embed), methods=["POST"]),
        Route("/api/embeddings", guarded(embeddings_api.ollama_embeddings), methods=["POST"]),
        Route("/api/tags", guarded(ollama_api.tags)),
        Route("/api/ps", guarded(models_api.ps)),
        Route("/models", guarded(models_api.router_models)),  # llama-server's router mode
        Route("/models/load", guarded(models_api.router_load), methods=["POST"]),
        Route("/models/unload", guarded(models_api.router_unload), methods=["POST"]),
        Route("/api/show", guarded(ollama_show.show), methods=["POST"]),
        Route("/api/pull", guarded(catalogue_api.pull), methods=["POST"]),  # operators only, as the next two
        Route("/api/copy", guarded(catalogue_api.copy), methods=["POST"]),
        Route("/api/delete", guarded(catalogue_api.delete), methods=["DELETE"]),
        Route("/api/version", ollama_api.version),  # Ollama clients probe it before anything else
        Route("/tokenize", guarded(tokenize_api.tokenize), methods=["POST"]),  # llama-server's
        Route("/detokenize", guarded(tokenize_api.detokenize), methods=["POST"]),
        Route("/apply-template", guarded(tokenize_api.apply_template), methods=["POST"]),
        *batch_api.routes(guarded),
        *observability_routes(settings, lambda: app.state.gateway.fleet.redis),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {ApiError: render_error}
    handlers.update({outage: render_outage for outage in OUTAGE_ERRORS})
    app = GatewayApp(routes=routes, lifespan=lifespan, exception_handlers=handlers,
                    middleware=[Middleware(RequestGuard, settings=settings.gateway)])
    return app


def observability_routes(settings: ServeSettings, redis: Callable[[], AsyncRedis]) -> list[Route | Mount]:
    """GET /metrics (Prometheus) and /dashboard, read with `redis()`: the gateway's one async
    client, which exists once the app has started. With API keys set, /metrics needs an
    operator's key; the dashboard page loads without one (so a browser can type a key in) and its
    JSON API needs one. Prompts are shown to operators, or with keys off only when
    `gateway.dashboard_prompts` is set."""
    from dispatcher.observe.dashboard import bearer_check, dashboard_app
    from dispatcher.observe.metrics import metrics_route

    metrics = metrics_route(redis, settings.pool)
    callers = caller_keys(settings.gateway)
    operators = [key.decode() for key, caller in callers if caller.operator]
    dashboard = dashboard_app(redis, shown_pool(settings.pool, settings.models),
                              show_prompts=settings.gateway.dashboard_prompts,
                              authorize=bearer_check(operators) if callers else None)
    if callers:
        metrics = Route("/metrics", guarded(operators_only(metrics.endpoint)))
    return [metrics, Mount("/dashboard", app=dashboard)]


def operators_only(handler: Handler) -> Handler:
    """Behind `guarded`: 403 for a tenant's key (operators' views show every tenant)."""

    @functools.wraps(handler)
    async def check(request: Request) -> Response:
        if not request.state.caller.operator:
            raise ApiError(403, "this route needs an operator's key (gateway.admin_keys)",
                           code="admin_key_required")
        return await handler(request)

    return check


def app_from_env() -> Starlette:
    """For uvicorn's --factory (and `fleet serve --workers N`): settings from FLEET_CONFIG and
    FLEET_* as `fleet serve` left them."""
    return create_app(load_serve_settings(os.environ.get("FLEET_CONFIG")))
