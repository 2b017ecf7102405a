"""`fleet serve`: run the OpenAI- and Ollama-compatible gateway (uvicorn) in front of the fleet.

Needs the `gateway` extra (pip install 'llama-fleet[gateway]'); this module imports it only when
the command runs, so the CLI works without it.

uvicorn bounds connections (gateway.max_connections) and idle kept-alive ones
(gateway.keep_alive_timeout) itself; a request head that trickles in or never ends is bounded
here (`head_guarded`): uvicorn's httptools parser has neither a time nor a size limit for it.
Bodies are bounded by the app's RequestGuard (dispatcher/gateway/app.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

import click

from backends.contract.settings import SettingsError

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
else:
    HttpToolsProtocol = object  # uvicorn is an extra: HeadSize's real base is given when it is used


class HeadGuard(asyncio.Protocol):
    """Mixed into uvicorn's HTTP protocol class: a request head (request line and headers) must
    be complete within `header_timeout` seconds of the connection opening, or of the first bytes
    after a response, or the connection ends (with a 408 when a head had begun). It relies on
    what both uvicorn protocols share: `cycle` is replaced per request."""

    header_timeout: float = 10.0
    max_header_bytes: int = 64 * 1024
    cycle: Any
    transport: Any
    _head_timer: asyncio.TimerHandle | None = None
    _head_begun = False

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        waiting = before is None or before.response_complete
        super().data_received(data)
        if self.cycle is not before:  # a head is complete: the body is RequestGuard's
            self._disarm_head_timer()
            self._head_begun = False
        elif waiting and not self.transport.is_closing():
            self._head_begun = True  # (or the unread rest of a body answered early: it must end too)
            if self._head_timer is None:
                self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        cycle = self.cycle
        self._head_timer = asyncio.get_running_loop().call_later(self.header_timeout, self._head_late, cycle)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self, cycle: Any) -> None:
        self._head_timer = None
        if self.cycle is not cycle or self.transport.is_closing():
            return
        if cycle is not None and not cycle.response_complete:
            return  # a request is being answered; the keep-alive timer takes over after it
        if self._head_begun:
            refuse(self.transport, 408, f"the request head did not arrive within {self.header_timeout:g}s "
                   "(gateway.header_timeout)")
        else:
            self.transport.close()


class HeadTooLarge(Exception):
    """Raised in httptools' header callback: the parser stops and uvicorn answers 400, which
    HeadSize turns into a 431."""


class HeadSize(HttpToolsProtocol):
    """httptools keeps any number of header bytes (h11 has h11_max_incomplete_event_size):
    count the request line and headers as they are parsed; past `max_header_bytes`, 431."""

    max_header_bytes: int = 64 * 1024
    _head_size = 0
    _head_too_large = False

    def on_message_begin(self) -> None:
        self._head_size = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._grow_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _grow_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > self.max_header_bytes:
            self._head_too_large = True
            raise HeadTooLarge

    def send_400_response(self, msg: str) -> None:
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        refuse(self.transport, 431, f"the request head is larger than {self.max_header_bytes} bytes "
               "(gateway.max_header_bytes)")


def refuse(transport: Any, status: int, why: str) -> None:
    """A plain answer written past the HTTP library (no request exists for it), then close."""
    phrase = {408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
    body = why.encode()
    transport.write(f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    transport.close()


def head_guarded(header_timeout: float, max_header_bytes: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11) behind HeadGuard's limits."""
    try:
        import httptools  # noqa: F401  (what uvicorn's "auto" picks too)
        guarded: type[HeadGuard] = __getattr__("GuardedHttp")
    except ImportError:
        guarded = __getattr__("GuardedH11")
    guarded.header_timeout = header_timeout
    guarded.max_header_bytes = max_header_bytes
    return guarded


def __getattr__(name: str) -> type[HeadGuard]:
    """GuardedHttp / GuardedH11, made on first use (uvicorn is an extra) under their own module
    names, so `--workers N` processes unpickle uvicorn's config with them; there they take the
    limits from the settings the command left in the environment."""
    if name not in ("GuardedHttp", "GuardedH11"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    bases: tuple[type, ...]
    if name == "GuardedHttp":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base

        bases = (HeadGuard, HeadSize, Base)
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        bases = (HeadGuard, H11Protocol)
    from dispatcher.gateway.settings import load_serve_settings

    gw = load_serve_settings(os.environ.get("FLEET_CONFIG")).gateway
    made = type(name, bases, {"__module__": __name__, "__qualname__": name,
                              "header_timeout": gw.header_timeout, "max_header_bytes": gw.max_header_bytes})
    globals()[name] = made
    return made


@click.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="worker-config.json (default: $FLEET_CONFIG or ./worker-config.json)")
@click.option("--host", default=None, help="address to listen on (default: gateway.host, 127.0.0.1)")
@click.option("--port", type=int, default=None, help="port (default: gateway.port, 8000)")
@click.option("--workers", type=int, default=None, help="gateway processes (default: gateway.workers, 1)")
@click.option("-v", "--verbose", is_flag=True)
def serve(config: str | None, host: str | None, port: int | None, workers: int | None, verbose: bool) -> None:
    """Serve OpenAI's (/v1) and Ollama's (/api) HTTP APIs on the fleet's workers."""
    try:
        import uvicorn

        from dispatcher.gateway.app import create_app
        from dispatcher.gateway.settings import load_serve_settings
    except ImportError as e:
        raise click.ClickException(f"`fleet serve` needs the gateway extra "
                                   f"(pip install 'llama-fleet[gateway]'): {e}") from None
    # command-line values travel as FLEET_* so that every uvicorn worker process sees them too
    for name, value in (("HOST", host), ("PORT", port), ("WORKERS", workers)):
        if value is not None:
            os.environ[f"FLEET_GATEWAY__{name}"] = str(value)
    if config:
        os.environ["FLEET_CONFIG"] = os.path.abspath(config)
    try:
        settings = load_serve_settings(config)
    except SettingsError as e:
        raise click.ClickException(str(e)) from None
    gw = settings.gateway
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options: dict[str, Any] = {"host": gw.host, "port": gw.port, "server_header": False,
                               "timeout_graceful_shutdown": gw.shutdown_grace,
                               "log_level": "debug" if verbose else "info",
                               "limit_concurrency": gw.max_connections,
                               "timeout_keep_alive": gw.keep_alive_timeout,
                               "h11_max_incomplete_event_size": gw.max_header_bytes,
                               "http": head_guarded(gw.header_timeout, gw.max_header_bytes)}
    if gw.workers > 1:
        uvicorn.run("dispatcher.gateway.app:app_from_env", factory=True, workers=gw.workers, **options)
    else:
        uvicorn.run(create_app(settings), **options)
