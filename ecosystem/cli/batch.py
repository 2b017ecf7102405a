"""`fleet batch`: submit an OpenAI batch file, follow it, cancel it, write its results."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import click
from redis import Redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from dispatcher.gateway.batch import control, record
from dispatcher.gateway.batch.lines import file_lines, scan
from dispatcher.gateway.batch.submit import (
    CHUNK,
    DEFAULT_RETENTION,
    BatchRefused,
    BatchSpec,
    default_batch_id,
    submit_batch,
)
from ecosystem.cli.options import config_option, friendly_errors, json_option, settings_and_redis

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """'24h', '30m', '7d', '90s' or plain seconds."""
    m = re.fullmatch(r"\s*([0-9]{1,9})\s*([smhd]?)\s*", text)  # ASCII digits: int() takes others too
    if not m or int(m.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is not a duration like 24h, 30m, 7d or 3600")
    return int(m.group(1)) * UNITS[m.group(2) or "s"]


@click.group("batch")
def batch() -> None:
    """Batches of requests from an OpenAI batch file (JSONL), run at low priority (docs/batch.md)."""


@batch.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@config_option()
@click.option("--id", "batch_id", default=None, help="batch id (default: from the file's lines, so a "
              "re-run resumes the same batch)")
@click.option("--priority", type=click.Choice(["high", "default", "low"]), default="low")
@click.option("--completion-window", default="24h", help="lines not started by then fail as expired")
@click.option("--retention", default=f"{DEFAULT_RETENTION // 86400}d", help="results kept after the end")
@click.option("--skip-invalid", is_flag=True, help="enqueue the good lines even if some are bad")
@click.option("--wait", is_flag=True, help="show progress until the batch ends")
@click.option("--chunk-size", type=click.IntRange(1, 10_000), default=CHUNK,
              help="lines per Redis transaction")
@friendly_errors
def submit(file: Path, config: str | None, batch_id: str | None, priority: str, completion_window: str,
           retention: str, skip_invalid: bool, wait: bool, chunk_size: int) -> None:
    """Check every line of FILE, then enqueue one job per line (only those not enqueued before)."""
    s, redis = settings_and_redis(config)
    window, keep = parse_duration(completion_window), parse_duration(retention)

    def open_lines() -> Any:
        return file_lines(file)

    found = scan(open_lines())
    for err in found.errors:
        click.echo(str(err), err=True)
    if found.invalid > len(found.errors):
        click.echo(f"... and {found.invalid - len(found.errors)} more bad lines", err=True)
    spec = BatchSpec(batch_id or default_batch_id(found.fingerprint), s.pool, priority, window, keep,
                     s.job_timeout, endpoint=_endpoint(found.kinds), input_name=str(file))
    console = Console(stderr=True)
    with Progress(TextColumn("enqueueing"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("enqueue", total=found.valid)
        try:
            report = submit_batch(redis, spec, open_lines, skip_invalid=skip_invalid, checked=found,
                                  chunk=chunk_size,
                                  progress=lambda done, total: bar.update(task, completed=done))
        except BatchRefused as e:
            raise click.ClickException(str(e)) from None
    verb = "created" if report.created else "resumed"
    click.echo(f"{report.batch_id}: {verb}, {report.enqueued} lines enqueued now "
               f"({found.valid} valid, {found.invalid} skipped), state {report.state}")
    if wait:
        follow(redis, report.batch_id, console)


def _endpoint(kinds: set[Any]) -> str:
    urls = sorted("/v1/chat/completions" if k == "chat" else "/v1/completions" for k in kinds)
    return ",".join(urls)


@batch.command()
@click.argument("batch_id")
@config_option()
@click.option("--wait", is_flag=True, help="show progress until the batch ends")
@json_option()
@friendly_errors
def status(batch_id: str, config: str | None, wait: bool, as_json: bool) -> None:
    """State and counts of a batch."""
    _, redis = settings_and_redis(config)
    state = _known(redis, batch_id)
    if wait:
        follow(redis, batch_id, Console(stderr=True))
        state = _known(redis, batch_id)
    if as_json:
        click.echo(json.dumps(state))
        return
    for name in ("id", "state", "model", "priority", "pool", "total", "enqueued", "running", "completed",
                 "failed", "cancelled", "invalid", "prompt_tokens", "completion_tokens", "input"):
        click.echo(f"{name:18} {state.get(name)}")
    for name in ("created_at", "in_progress_at", "expires_at", "cancelling_at", "completed_at",
                 "cancelled_at"):
        if state.get(name):
            click.echo(f"{name:18} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(state[name]))}")


def _known(redis: Redis, batch_id: str) -> dict[str, Any]:
    state = control.status(redis, batch_id)
    if state is None:
        raise click.ClickException(f"no batch {batch_id!r} (unknown, or its record expired)")
    return state


@batch.command(name="list")
@config_option()
@json_option()
@friendly_errors
def list_(config: str | None, as_json: bool) -> None:
    """Batches, newest first."""
    _, redis = settings_and_redis(config)
    batches = control.list_batches(redis)
    if as_json:
        click.echo(json.dumps(batches))
        return
    table = Table()
    for col in ("id", "state", "total", "completed", "failed", "cancelled", "created"):
        table.add_column(col)
    for b in batches:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(b["created_at"] or 0))
        table.add_row(b["id"], b["state"], str(b["total"]), str(b["completed"]), str(b["failed"]),
                      str(b["cancelled"]), created)
    Console().print(table)


@batch.command()
@click.argument("batch_id")
@config_option()
@friendly_errors
def cancel(batch_id: str, config: str | None) -> None:
    """Drop the batch's queued lines and stop its running ones."""
    s, redis = settings_and_redis(config)
    try:
        state = control.cancel(redis, batch_id, s.job_timeout)
    except KeyError:
        raise click.ClickException(f"no batch {batch_id!r}") from None
    click.echo(f"{batch_id}: {state}")


@batch.command()
@click.argument("batch_id")
@config_option()
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="failed and cancelled lines go here (default: into the output file)")
@friendly_errors
def results(batch_id: str, config: str | None, output: Path, errors: Path | None) -> None:
    """Write the batch's results in OpenAI's batch output format (JSONL), streamed."""
    _, redis = settings_and_redis(config)
    state = _known(redis, batch_id)
    with output.open("w", encoding="utf-8") as out:
        err = errors.open("w", encoding="utf-8") if errors else None
        try:
            n_out, n_err = control.write_results(redis, batch_id, out, err)
        finally:
            if err is not None:
                err.close()
    ended = sum(state[k] or 0 for k in ("completed", "failed", "cancelled"))
    pending = (state["enqueued"] or 0) - ended
    click.echo(f"{batch_id}: {n_out} lines to {output}" + (f", {n_err} to {errors}" if errors else "")
               + (f"; {pending} lines not ended yet (state {state['state']})" if pending > 0 else ""))


def follow(redis: Redis, batch_id: str, console: Console, interval: float = 1.0) -> dict[str, Any]:
    """A live bar (done / failed / running, tok/s, ETA) until the batch ends."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}"))
    history: list[tuple[float, int, int]] = []  # (time, lines ended, completion tokens)
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(batch_id, total=None, detail="")
        while True:
            state = control.status(redis, batch_id)
            if state is None:
                raise click.ClickException(f"batch {batch_id} disappeared (expired?)")
            ended = sum(state[k] or 0 for k in ("completed", "failed", "cancelled"))
            now = time.monotonic()
            history = [*history, (now, ended, state["completion_tokens"] or 0)][-30:]
            t0, e0, k0 = history[0]
            span = now - t0
            rate, tok_s = ((ended - e0) / span, (history[-1][2] - k0) / span) if span > 0 else (0.0, 0.0)
            left = (state["total"] or 0) - ended
            eta = f"{left / rate:.0f}s" if rate > 0 and left > 0 else "-"
            detail = (f"done {state['completed']}  failed {state['failed']}  running {state['running']}  "
                      f"{tok_s:.0f} tok/s  ETA {eta}  [{state['state']}]")
            bar.update(task, total=state["total"], completed=ended, detail=detail)
            if state["state"] in record.FINAL_STATES:
                return state
            time.sleep(interval)


def register(cli: click.Group) -> None:
    cli.add_command(batch)
