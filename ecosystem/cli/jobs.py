"""One job at a time: `fleet submit`, `fleet job ID`, `fleet jobs`. The viewers' tables load
when they run, so `fleet submit` stays as light as `fleet worker`."""

from __future__ import annotations

import json
from typing import Any

import click

from dispatcher.client import Fleet, JobFailed, JobTimeout
from ecosystem.cli.options import config_option, friendly_errors, json_option, settings_and_redis


@click.command()
@click.argument("prompt")
@config_option()
@click.option("--max-tokens", type=int, default=None)
@click.option("--temperature", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--priority", type=click.Choice(["high", "default", "low"]), default="default")
@click.option("--stream", "do_stream", is_flag=True, help="print tokens as they arrive")
@json_option("print the result as one JSON object")
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
    except KeyboardInterrupt:  # nobody reads the rest: stop the worker generating it
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


@click.command()
@config_option()
@click.option("--failed", "kind", flag_value="failed", help="failed jobs, newest first")
@click.option("--running", "kind", flag_value="running", help="jobs workers hold now")
@click.option("--queued", "kind", flag_value="queued", help="waiting jobs, next to run first")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@json_option()
@friendly_errors
def jobs(config: str | None, kind: str | None, limit: int, as_json: bool) -> None:
    """Recent jobs (or --failed / --running / --queued): state, worker, attempts, TTFT, total."""
    from rich.console import Console

    from dispatcher.observe import history, tables

    s, redis = settings_and_redis(config)
    records = history.listing(redis, s.pool, kind or "recent", limit)
    if as_json:
        click.echo(json.dumps(records))
        return
    Console().print(tables.jobs_table(records, f"{kind or 'recent'} jobs (pool {s.pool})"))


@click.command()
@click.argument("job_id")
@config_option()
@json_option()
@friendly_errors
def job(job_id: str, config: str | None, as_json: bool) -> None:
    """One job: params, worker, backend, every attempt and why it was restarted, timings, error."""
    from rich.console import Console

    from dispatcher.observe import history, tables

    _s, redis = settings_and_redis(config)
    record = history.get(redis, history.resolve(redis, job_id))
    if record is None:
        raise click.ClickException(f"no job {job_id!r}: unknown, or its history expired")
    if as_json:
        click.echo(json.dumps(record))
        return
    Console().print(tables.job_view(record))


def register(cli: click.Group) -> None:
    for command in (submit, jobs, job):
        cli.add_command(command)
