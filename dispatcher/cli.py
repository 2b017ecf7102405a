"""The `fleet` command line: worker, submit, status (+ plan, ecosystem, up, down, bench)."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backends.contract.connect import redis_from_url
from backends.contract.redact import redact_url
from dispatcher.client import Fleet, JobFailed, JobTimeout
from worker.settings import FleetSettings, SettingsError, load_settings

F = TypeVar("F", bound=Callable[..., Any])
config_option = click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                             help="worker-config.json (default: $FLEET_CONFIG or ./worker-config.json)")


def friendly_errors(func: F) -> F:
    """Settings and Redis problems end in one readable line, not a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SettingsError as e:
            raise click.ClickException(str(e)) from None
        except (RedisConnectionError, RedisTimeoutError) as e:
            url = click.get_current_context().meta.get("redis_url", "?")
            raise click.ClickException(f"cannot reach Redis at {redact_url(url)}: {e}") from None

    return wrapper  # type: ignore[return-value]


def settings_and_redis(config: str | None, **overrides: Any) -> tuple[FleetSettings, Redis]:
    s = load_settings(config, **{k: v for k, v in overrides.items() if v is not None})
    click.get_current_context().meta["redis_url"] = s.redis_url
    # a socket timeout and keepalive so a half-open connection cannot block the worker loop
    redis = redis_from_url(s.redis_url, socket_connect_timeout=3, socket_timeout=10, socket_keepalive=True,
                           health_check_interval=30)
    redis.ping()
    return s, redis


class FleetGroup(click.Group):
    """The core commands (worker, submit) are defined here; the rest register on first use, so
    `fleet worker` does not import the gateway, batch, bench and Kubernetes code at every start."""

    _extensions_loaded = False

    def _load_extensions(self) -> None:
        if not self._extensions_loaded:
            self._extensions_loaded = True
            _register_extensions(self)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None:
            self._load_extensions()
            command = super().get_command(ctx, cmd_name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load_extensions()
        return super().list_commands(ctx)


@click.group(cls=FleetGroup)
def cli() -> None:
    """llama-fleet: batched llama.cpp workers serving generation jobs from Redis."""


@cli.command()
@config_option
@click.option("--cpus", default=None, help="pin to these CPUs, e.g. 0-3 (overrides config)")
@click.option("--name", default=None, help="worker name (default: host-pid)")
@click.option("--burst", is_flag=True, help="exit once no job is queued for the pool and none is in flight")
@click.option("-v", "--verbose", is_flag=True)
@friendly_errors
def worker(config: str | None, cpus: str | None, name: str | None, burst: bool, verbose: bool) -> None:
    """Run one worker: pin, load the model, serve jobs until SIGTERM/SIGINT (or, with --burst,
    until the pool's queues are empty; it prints what ended, by outcome, as JSON)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from backends.base import BackendUnavailable
    from worker.main import WorkerNameTaken, run_worker

    s, redis = settings_and_redis(config, cpus=cpus, name=name)
    try:
        summary = run_worker(s, redis, burst=burst)
    except (WorkerNameTaken, BackendUnavailable, ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    if summary is not None:
        click.echo(json.dumps({"idle": summary.idle, "ended": summary.ended, "seconds": summary.seconds}))


@cli.command()
@click.argument("prompt")
@config_option
@click.option("--max-tokens", type=int, default=None)
@click.option("--temperature", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--priority", type=click.Choice(["high", "default", "low"]), default="default")
@click.option("--stream", "do_stream", is_flag=True, help="print tokens as they arrive")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
@click.option("--timeout", type=float, default=300.0, help="seconds to wait for the result")
@click.option("--queue-ttl", type=int, default=None, help="fail the job if it waits longer in the queue")
@click.option("--job-timeout", type=int, default=None, help="fail the job if it runs longer")
@click.option("--detach", is_flag=True, help="on Ctrl-C, leave the job running (default: cancel it)")
@friendly_errors
def submit(prompt: str, config: str | None, max_tokens: int | None, temperature: float | None,
           seed: int | None, stop: tuple[str, ...], priority: str, do_stream: bool, as_json: bool,
           timeout: float, queue_ttl: int | None, job_timeout: int | None, detach: bool) -> None:
    """Submit one generation job and wait for its result. Ctrl-C cancels it (unless --detach)."""
    s, redis = settings_and_redis(config)
    fleet = Fleet(redis=redis, pool=s.pool, result_ttl=s.result_ttl, job_timeout=s.job_timeout,
                  queue_ttl=s.queue_ttl)
    fields: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                              "stop": list(stop) or None}
    job = None
    try:
        job = fleet.submit(prompt, priority=priority, queue_ttl=queue_ttl, job_timeout=job_timeout,
                           **{k: v for k, v in fields.items() if v is not None})
        if do_stream and not as_json:
            for text in job.stream(timeout=timeout, detach=detach):
                click.echo(text, nl=False)
            click.echo()
        res = job.result(timeout=timeout)
    except KeyboardInterrupt:  # nobody reads the rest: stop the worker generating it (issue 10, #12)
        if job is not None and not detach:
            job.cancel_quietly()
            click.echo(f"\ncancelled job {job.id}", err=True)
        elif job is not None:
            click.echo(f"\ndetached: job {job.id} goes on", err=True)
        raise SystemExit(130) from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except (JobFailed, JobTimeout) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(res))
    elif not do_stream:
        click.echo(res["text"])
    if not as_json:
        t = res["timings"]
        click.echo(f"[{res['finish_reason']}, {res['usage']['completion_tokens']} tokens, "
                   f"worker {res['worker']} ({res['backend']}), ttft {t['ttft_ms']} ms, "
                   f"{t['tokens_per_s']} tok/s]", err=True)


def _register_extensions(group: click.Group) -> None:
    from dispatcher.batch import cli as batch_cli
    from dispatcher.gateway.serve import serve
    from dispatcher.observe import cli as observe_cli
    from ecosystem.cli import register
    from ecosystem.local import bench
    from worker import health

    register(group)
    bench.register(group)
    batch_cli.register(group)
    observe_cli.register(group)
    health.register(group)
    group.add_command(serve)


def main() -> None:
    cli(prog_name="fleet")


if __name__ == "__main__":
    main()
    sys.exit(0)
