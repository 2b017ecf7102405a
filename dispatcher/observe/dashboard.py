"""The web dashboard: a Starlette app with one page and a small JSON API the page polls.

Mount it in the gateway with `Mount("/dashboard", app=dashboard_app(redis, pool, ...))` (its async
client, or a callable returning it), or run it alone with `fleet dashboard` (a sync client). No
build step, no CDN: the page, its CSS and its JS (hand-written SVG charts) are package data in
dispatcher/observe/static/.

Who sees what (docs/observability.md): with `authorize` (the gateway's API keys) the JSON API
needs a key (the page sends the one typed into it as `Authorization: Bearer`), and a key holder
sees prompts; without it, prompts and other request text are redacted unless `show_prompts`.
The page and its static files hold no data and stay open, so a browser can load the page first.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable
from importlib.resources import files
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dispatcher.observe import history, snapshot
from dispatcher.plans import ClientSource, run_on
from dispatcher.tenants import usage_plan

STATIC = files("dispatcher.observe") / "static"
JOBS_LIMIT = 200
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # RQ's job id characters; nothing else names a key
HIDDEN = "(hidden)"
Authorize = Callable[[str | None], bool]  # the Authorization header -> a valid key?


def bearer_check(keys: list[str]) -> Authorize:
    """`Authorization: Bearer <key>` with one of `keys`, compared in constant time."""
    encoded = [k.encode() for k in keys]

    def check(authorization: str | None) -> bool:
        scheme, _, given = (authorization or "").partition(" ")
        token = given.strip().encode()
        return scheme.lower() == "bearer" and bool(token) and any(
            [hmac.compare_digest(token, key) for key in encoded])

    return check


def redacted(record: dict[str, Any]) -> dict[str, Any]:
    """A job record without request text: numbers and flags of its params stay (max_tokens,
    temperature, the number of messages), every string, list or object becomes HIDDEN."""
    params = record.get("params")
    if not isinstance(params, dict):
        return record
    shown = {k: (v if isinstance(v, int | float | bool) or v is None else HIDDEN) for k, v in params.items()}
    return {**record, "params": shown, "redacted": True}


def dashboard_app(redis: ClientSource, pool: str, *, with_metrics: bool = False, show_prompts: bool = False,
                  authorize: Authorize | None = None) -> Starlette:
    """The dashboard as an ASGI app; its links are relative, so any mount path works."""
    page = (STATIC / "index.html").read_text(encoding="utf-8")

    def refused(request: Request) -> Response | None:
        """401 for the JSON API without a valid key (when keys are on)."""
        if authorize is None or authorize(request.headers.get("authorization")):
            return None
        return JSONResponse({"error": "Incorrect or missing API key: type one into the dashboard's key "
                             "field (sent as 'Authorization: Bearer <key>')"}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})

    def visible(record: dict[str, Any]) -> dict[str, Any]:
        # a key holder (keys on) is an operator; without keys only the setting shows prompts
        return record if show_prompts or authorize is not None else redacted(record)

    async def index(request: Request) -> Response:
        base = request.scope.get("root_path", "").rstrip("/") + "/"
        return HTMLResponse(page.replace("{{base}}", base).replace("{{pool}}", pool))

    async def api_status(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        return JSONResponse(await run_on(redis, snapshot.snapshot_plan(pool)))

    async def api_jobs(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        kind = request.query_params.get("kind", "recent")
        if kind not in history.KINDS:
            return JSONResponse({"error": f"kind must be one of {', '.join(history.KINDS)}"}, status_code=400)
        try:
            limit = int(request.query_params.get("limit", "50"))
        except ValueError:
            return JSONResponse({"error": "limit must be a number"}, status_code=400)
        limit = max(1, min(limit, JOBS_LIMIT))
        records = await run_on(redis, history.listing_plan(pool, kind, limit))
        return JSONResponse([visible(r) for r in records])

    async def api_job(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        job_id = request.path_params["job_id"]
        record: dict[str, Any] | None = None
        if JOB_ID.fullmatch(job_id):
            record = await run_on(redis, history.get_plan(job_id))
        if record is None:
            return JSONResponse({"error": "no such job (unknown, or its history expired)"}, status_code=404)
        return JSONResponse(visible(record))

    async def api_usage(request: Request) -> Response:
        """Every tenant's usage over the last 24 hours (docs/tenants.md)."""
        if (no := refused(request)) is not None:
            return no
        return JSONResponse(await run_on(redis, usage_plan(None, 24)))

    routes: list[Any] = [
        Route("/", index),
        Route("/api/status", api_status),
        Route("/api/jobs", api_jobs),
        Route("/api/job/{job_id:str}", api_job),
        Route("/api/usage", api_usage),
        Mount("/static", app=StaticFiles(packages=[("dispatcher.observe", "static")])),
    ]
    if with_metrics:
        from dispatcher.observe.metrics import metrics_route

        routes.append(metrics_route(redis, pool))
    return Starlette(routes=routes)
