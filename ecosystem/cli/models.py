"""`fleet models pull|cp|rm|ls`: the catalogue changed live through a gateway's Ollama routes
(dispatcher/gateway/catalogue_api.py owns the change; this is its client), a pull's progress as
rich progress bars, one per file."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn
from rich.table import Table

F = TypeVar("F", bound=Callable[..., Any])
TIMEOUT = httpx.Timeout(30.0, read=None)  # a pull's lines may be minutes apart while a worker loads


def gateway_options(func: F) -> F:
    func = click.option("--url", envvar="FLEET_GATEWAY_URL", default="http://127.0.0.1:8000",
                        show_default=True, help="the gateway (env FLEET_GATEWAY_URL)")(func)
    return click.option("--api-key", envvar="FLEET_API_KEY", default=None,
                        help="an operator's key (env FLEET_API_KEY)")(func)


def call(method: str, url: str, path: str, api_key: str | None, body: dict[str, Any] | None = None,
         ) -> httpx.Response:
    try:
        r = httpx.request(method, url.rstrip("/") + path, json=body, headers=auth(api_key), timeout=TIMEOUT)
    except httpx.TransportError as e:
        raise click.ClickException(f"cannot reach the gateway at {url}: {e}") from None
    if r.status_code >= 400:
        raise click.ClickException(said_error(r))
    return r


def auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def said_error(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error") or r.text)
    except ValueError:
        return f"HTTP {r.status_code}: {r.text[:200]}"


@click.group()
def models() -> None:
    """The model catalogue: pull (fetch onto the workers' hosts), cp, rm, ls."""


@models.command()
@click.argument("name")
@click.option("--from", "source_url", default=None, help="the file's URL (HTTP(S), Hugging Face resolve)")
@click.option("--sha256", default=None, help="the file's sha256 (with --from)")
@gateway_options
def pull(name: str, source_url: str | None, sha256: str | None, api_key: str | None, url: str) -> None:
    """Fetch NAME (a catalogue model with a URL, or a new one --from a URL) and load it."""
    body: dict[str, Any] = {"model": name, "stream": True}
    if source_url is not None or sha256 is not None:
        body.update(url=source_url, sha256=sha256)
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console) as bars:
        tasks: dict[str, TaskID] = {}
        try:
            with httpx.stream("POST", url.rstrip("/") + "/api/pull", json=body, headers=auth(api_key),
                              timeout=TIMEOUT) as r:
                if r.status_code >= 400:
                    r.read()
                    raise click.ClickException(said_error(r))
                for line in r.iter_lines():
                    if line.strip():
                        show(json.loads(line), bars, tasks, console)
        except httpx.TransportError as e:
            raise click.ClickException(f"cannot reach the gateway at {url}: {e}") from None


def show(event: dict[str, Any], bars: Progress, tasks: dict[str, TaskID], console: Console) -> None:
    """One line of a pull: a file's bar moved, a step said, or its error."""
    if "error" in event:
        raise click.ClickException(str(event["error"]))
    digest = event.get("digest")
    if digest and isinstance(event.get("total"), int):
        if digest not in tasks:
            tasks[digest] = bars.add_task(str(event.get("status")), total=event["total"])
        bars.update(tasks[digest], completed=int(event.get("completed") or 0), total=event["total"])
    else:
        console.print(str(event.get("status", "")))


@models.command()
@click.argument("source")
@click.argument("destination")
@gateway_options
def cp(source: str, destination: str, api_key: str | None, url: str) -> None:
    """Copy SOURCE to DESTINATION: a model of its own over the same file."""
    call("POST", url, "/api/copy", api_key, {"source": source, "destination": destination})
    click.echo(f"copied '{source}' to '{destination}'")


@models.command()
@click.argument("name")
@gateway_options
def rm(name: str, api_key: str | None, url: str) -> None:
    """Delete NAME from the catalogue (the files stay in the hosts' caches)."""
    call("DELETE", url, "/api/delete", api_key, {"model": name})
    click.echo(f"deleted '{name}'")


@models.command()
@gateway_options
def ls(api_key: str | None, url: str) -> None:
    """The catalogue's models as the gateway lists them (Ollama's /api/tags)."""
    listed = call("GET", url, "/api/tags", api_key).json().get("models", [])
    table = Table("NAME", "SIZE", "DIGEST")
    for m in listed:
        size = m.get("size") or 0
        table.add_row(str(m.get("name")), f"{size / 2**20:.0f} MB" if size else "-",
                      str(m.get("digest") or "")[:12])
    Console().print(table)


def register(cli: click.Group) -> None:
    cli.add_command(models)
