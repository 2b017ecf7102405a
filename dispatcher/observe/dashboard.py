"""The web dashboard: a Starlette app with one page and a small JSON API the page polls.

Mount it in the gateway with `Mount("/dashboard", app=dashboard_app(redis, pool))`, or run it
alone with `fleet dashboard`. No build step, no CDN: the page, its CSS and its JS (hand-written
SVG charts) are package data in dispatcher/observe/static/.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from redis import Redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dispatcher.observe import history, snapshot

STATIC = files("dispatcher.observe") / "static"
JOBS_LIMIT = 200


def dashboard_app(redis: Redis, pool: str, *, with_metrics: bool = False) -> Starlette:
    """The dashboard as an ASGI app; its links are relative, so any mount path works."""
    page = (STATIC / "index.html").read_text(encoding="utf-8")

    async def index(request: Request) -> Response:
        base = request.scope.get("root_path", "").rstrip("/") + "/"
        return HTMLResponse(page.replace("{{base}}", base).replace("{{pool}}", pool))

    async def api_status(_request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(snapshot.snapshot, redis, pool))

    async def api_jobs(request: Request) -> Response:
        kind = request.query_params.get("kind", "recent")
        if kind not in history.KINDS:
            return JSONResponse({"error": f"kind must be one of {', '.join(history.KINDS)}"}, status_code=400)
        try:
            limit = int(request.query_params.get("limit", "50"))
        except ValueError:
            return JSONResponse({"error": "limit must be a number"}, status_code=400)
        limit = max(1, min(limit, JOBS_LIMIT))
        return JSONResponse(await run_in_threadpool(history.listing, redis, pool, kind, limit))

    async def api_job(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        record: dict[str, Any] | None = await run_in_threadpool(history.get, redis, job_id)
        if record is None:
            return JSONResponse({"error": "no such job (unknown, or its history expired)"}, status_code=404)
        return JSONResponse(record)

    routes: list[Any] = [
        Route("/", index),
        Route("/api/status", api_status),
        Route("/api/jobs", api_jobs),
        Route("/api/job/{job_id:str}", api_job),
        Mount("/static", app=StaticFiles(packages=[("dispatcher.observe", "static")])),
    ]
    if with_metrics:
        from dispatcher.observe.metrics import metrics_route

        routes.append(metrics_route(redis, pool))
    return Starlette(routes=routes)
