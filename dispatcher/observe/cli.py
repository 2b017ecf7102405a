"""`fleet status [--watch]`, `fleet jobs`, `fleet job ID`, `fleet metrics`, `fleet dashboard`;
dispatcher/cli.py adds them with `register(cli)`."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click
from redis import Redis
from rich.console import Console
from rich.live import Live
from rich.text import Text

from backends.contract.retry import OUTAGE_ERRORS
from dispatcher.observe import history, snapshot, tables

F = TypeVar("F", bound=Callable[..., Any])
config_option = click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                             help="worker-config.json (default: $FLEET_CONFIG or ./worker-config.json)")


def friendly(func: F) -> F:
    """dispatcher.cli's one-line errors; imported when the command runs (that module imports this one)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from dispatcher.cli import friendly_errors

        return friendly_errors(func)(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def connect(config: str | None) -> tuple[Any, Redis]:
    from dispatcher.cli import settings_and_redis

    return settings_and_redis(config)


def header(pool: str, redis_url: str) -> str:
    from backends.contract.redact import redact_url

    return f"llama-fleet · pool {pool} · redis {redact_url(redis_url)} · {time.strftime('%H:%M:%S')}"


@click.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="one JSON object (workers, queues, totals, counters)")
@click.option("--watch", is_flag=True, help="redraw in place until Ctrl-C")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=1.0, show_default=True,
              help="seconds between redraws with --watch")
@friendly
def status(config: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Workers (state, slots, tok/s, CPU, RSS, backend health, jobs) and queues, with totals."""
    s, redis = connect(config)
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
@config_option
@click.option("--failed", "kind", flag_value="failed", help="failed jobs, newest first")
@click.option("--running", "kind", flag_value="running", help="jobs workers hold now")
@click.option("--queued", "kind", flag_value="queued", help="waiting jobs, next to run first")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def jobs(config: str | None, kind: str | None, limit: int, as_json: bool) -> None:
    """Recent jobs (or --failed / --running / --queued): state, worker, attempts, TTFT, total."""
    s, redis = connect(config)
    records = history.listing(redis, s.pool, kind or "recent", limit)
    if as_json:
        click.echo(json.dumps(records))
        return
    Console().print(tables.jobs_table(records, f"{kind or 'recent'} jobs (pool {s.pool})"))


@click.command()
@click.argument("job_id")
@config_option
@click.option("--json", "as_json", is_flag=True)
@friendly
def job(job_id: str, config: str | None, as_json: bool) -> None:
    """One job: params, worker, backend, every attempt and why it was restarted, timings, error."""
    _s, redis = connect(config)
    record = history.get(redis, history.resolve(redis, job_id))
    if record is None:
        raise click.ClickException(f"no job {job_id!r}: unknown, or its history expired")
    if as_json:
        click.echo(json.dumps(record))
        return
    Console().print(tables.job_view(record))


@click.command()
@config_option
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=9400, show_default=True)
@friendly
def metrics(config: str | None, host: str, port: int) -> None:
    """Serve Prometheus metrics (read from Redis on every scrape) at http://HOST:PORT/metrics."""
    from dispatcher.observe.metrics import serve

    s, redis = connect(config)
    click.echo(f"serving metrics on http://{host}:{port}/metrics (pool {s.pool})", err=True)
    serve(redis, s.pool, host, port)


@click.command()
@config_option
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=9401, show_default=True)
@click.option("--show-prompts", is_flag=True, help="show prompts and request text to anyone who can reach "
              "the page (default: redacted, unless gateway.dashboard_prompts or gateway.api_keys is set)")
@friendly
def dashboard(config: str | None, host: str, port: int, show_prompts: bool) -> None:
    """Serve the web dashboard (workers, queues, live charts, jobs) at http://HOST:PORT/. With
    gateway.api_keys in the config, its JSON API needs one of those keys, as the gateway's does."""
    import uvicorn

    from dispatcher.gateway.settings import load_serve_settings
    from dispatcher.observe.dashboard import bearer_check, dashboard_app

    s, redis = connect(config)
    gateway = load_serve_settings(config).gateway
    keys = [k.get_secret_value() for k in gateway.api_keys]
    app = dashboard_app(redis, s.pool, with_metrics=True,
                        show_prompts=show_prompts or gateway.dashboard_prompts,
                        authorize=bearer_check(keys) if keys else None)
    click.echo(f"dashboard on http://{host}:{port}/ (pool {s.pool})", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(cli: click.Group) -> None:
    for command in (status, jobs, job, metrics, dashboard):
        cli.add_command(command)
