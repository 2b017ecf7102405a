"""`fleet health`: is this host's worker alive, is it ready? For Kubernetes exec probes and
process managers.

The worker's heartbeat thread rewrites a small JSON file (`health_file` setting) every beat,
whether Redis answers or not; the probe reads only that file. So liveness never depends on
Redis: a worker riding out a Redis outage keeps generating and must not be restarted for it.
- alive: the file was rewritten within 3 heartbeat intervals (+ 2 s slack) by a process that
  still exists. A stuck heartbeat thread or a hung process fails it.
- ready: alive, past model loading, not draining, and its last talk with Redis succeeded.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import psutil

if TYPE_CHECKING:
    from worker.serving.loop import FleetWorker

READY_STATES = ("idle", "busy")
SLACK_S = 2.0


def write_health(path: Path, fw: FleetWorker) -> None:
    """Atomically replace the health file (a reader never sees half a file)."""
    record = {"name": fw.name, "pid": os.getpid(), "state": fw.counters.state, "redis_up": fw.link.up,
              "interval": fw.settings.heartbeat_interval, "at": time.time()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def check_health(path: Path, ready: bool, now: float | None = None) -> tuple[bool, str]:
    """(ok, reason) for the liveness (ready=False) or readiness (ready=True) question."""
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return False, f"no health file at {path} (worker not started yet, or health_file differs)"
    except (OSError, ValueError) as e:
        return False, f"unreadable health file {path}: {e}"
    age = (now if now is not None else time.time()) - float(record.get("at", 0))
    limit = 3 * float(record.get("interval", 1.0)) + SLACK_S
    if age > limit:
        return False, f"worker {record.get('name')} last beat {age:.1f}s ago (limit {limit:.1f}s)"
    if not _pid_exists(int(record.get("pid", 0))):
        return False, f"worker {record.get('name')} (pid {record.get('pid')}) is gone"
    state = str(record.get("state"))
    if ready and state not in READY_STATES:
        return False, f"worker {record.get('name')} is {state}"
    if ready and not record.get("redis_up"):
        return False, f"worker {record.get('name')} cannot reach Redis"
    return True, f"worker {record.get('name')} {state}, beat {age:.1f}s ago"


def _pid_exists(pid: int) -> bool:
    return pid > 0 and psutil.pid_exists(pid)


@click.command("health")
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="worker-config.json (default: $FLEET_CONFIG or ./worker-config.json)")
@click.option("--ready", "ready", is_flag=True, help="readiness (default: liveness)")
@click.option("--file", "file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="health file [default: the health_file setting]")
def health_command(config: str | None, ready: bool, file: Path | None) -> None:
    """Exit 0 if this host's worker is alive (or, with --ready, ready to take jobs), else 1."""
    from worker.settings import SettingsError, load_settings

    if file is None:
        try:
            file = load_settings(config).health_file
        except SettingsError as e:
            raise click.ClickException(str(e)) from None
    if file is None:
        raise click.ClickException("no health file: set health_file (FLEET_HEALTH_FILE) or pass --file")
    ok, reason = check_health(file, ready)
    click.echo(("ok: " if ok else "not ok: ") + reason, err=not ok)
    raise SystemExit(0 if ok else 1)


def register(cli: click.Group) -> None:
    cli.add_command(health_command)
