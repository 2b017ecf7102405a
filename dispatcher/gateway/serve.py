"""`fleet serve`: run the OpenAI- and Ollama-compatible gateway (uvicorn) in front of the fleet.

Needs the `gateway` extra (pip install 'llama-fleet[gateway]'); this module imports it only when
the command runs, so the CLI works without it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import click

from backends.contract.settings import SettingsError


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
                               "log_level": "debug" if verbose else "info"}
    if gw.workers > 1:
        uvicorn.run("dispatcher.gateway.app:app_from_env", factory=True, workers=gw.workers, **options)
    else:
        uvicorn.run(create_app(settings), **options)
