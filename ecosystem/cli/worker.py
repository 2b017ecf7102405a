"""`fleet worker`: one worker process."""

from __future__ import annotations

import json
import logging

import click

from ecosystem.cli.options import config_option, friendly_errors, settings_and_redis


@click.command()
@config_option()
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


def register(cli: click.Group) -> None:
    cli.add_command(worker)
