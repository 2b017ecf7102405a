"""Watching the fleet: `fleet status [--watch]`, `fleet metrics`, `fleet dashboard`."""

from __future__ import annotations

import json
import time
from typing import Any

import click
from rich.console import Console
from rich.live import Live
from rich.text import Text

from backends.contract.catalogue import shown_pool
from backends.contract.redact import redact_url
from backends.contract.retry import OUTAGE_ERRORS
from dispatcher.observe import snapshot, tables
from ecosystem.cli.options import config_option, friendly_errors, json_option, settings_and_redis


def header(pool: str, redis_url: str) -> str:
    return f"llama-fleet · pool {pool} · redis {redact_url(redis_url)} · {time.strftime('%H:%M:%S')}"


@click.command()
@config_option()
@json_option("one JSON object (workers, queues, totals, counters)")
@click.option("--watch", is_flag=True, help="redraw in place until Ctrl-C")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=1.0, show_default=True,
              help="seconds between redraws with --watch")
@click.option("--pool", "pool", default=None, help="the pool to show (a catalogue model's: its pool); "
              "default: the config's pool, or with a model catalogue its first model's")
@friendly_errors
def status(config: str | None, as_json: bool, watch: bool, interval: float, pool: str | None) -> None:
    """Workers (state, slots, tok/s, CPU, RSS, backend health, jobs, models loaded), queues, totals."""
    s, redis = settings_and_redis(config)
    s.pool = pool or shown_pool(s.pool, s.models)
    if as_json:
        click.echo(json.dumps(snapshot.snapshot(redis, s.pool)))
        return
    console = Console()
    if not watch:
        console.print(tables.status_view(snapshot.snapshot(redis, s.pool), header(s.pool, s.redis_url)))
        return
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while True:
                try:
                    snap = snapshot.snapshot(redis, s.pool)
                    view: Any = tables.status_view(snap, header(s.pool, s.redis_url))
                except OUTAGE_ERRORS as e:  # keep watching: Redis may come back
                    view = Text(f"{header(s.pool, s.redis_url)}\nRedis unreachable: {e}", style="red")
                live.update(view, refresh=True)
                time.sleep(interval)
        except KeyboardInterrupt:
            pass


@click.command()
@config_option()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=9400, show_default=True)
@friendly_errors
def metrics(config: str | None, host: str, port: int) -> None:
    """Serve Prometheus metrics (read from Redis on every scrape) at http://HOST:PORT/metrics."""
    from dispatcher.observe.metrics import serve

    s, redis = settings_and_redis(config)
    click.echo(f"serving metrics on http://{host}:{port}/metrics (pool {s.pool})", err=True)
    serve(redis, s.pool, host, port)


@click.command()
@config_option()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=9401, show_default=True)
@click.option("--show-prompts", is_flag=True, help="show prompts and request text to anyone who can reach "
              "the page (default: redacted, unless gateway.dashboard_prompts or gateway.api_keys is set)")
@friendly_errors
def dashboard(config: str | None, host: str, port: int, show_prompts: bool) -> None:
    """Serve the web dashboard (workers, queues, live charts, jobs) at http://HOST:PORT/. With
    API keys in the config, its JSON API needs an operator's key, as the gateway's does."""
    import uvicorn

    from dispatcher.gateway.core import caller_keys
    from dispatcher.gateway.settings import load_serve_settings
    from dispatcher.observe.dashboard import bearer_check, dashboard_app

    s, redis = settings_and_redis(config)
    gateway = load_serve_settings(config).gateway
    callers = caller_keys(gateway)
    operators = [key.decode() for key, caller in callers if caller.operator]
    app = dashboard_app(redis, shown_pool(s.pool, s.models), with_metrics=True,
                        show_prompts=show_prompts or gateway.dashboard_prompts,
                        authorize=bearer_check(operators) if callers else None)
    click.echo(f"dashboard on http://{host}:{port}/ (pool {shown_pool(s.pool, s.models)})", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(cli: click.Group) -> None:
    for command in (status, metrics, dashboard):
        cli.add_command(command)
