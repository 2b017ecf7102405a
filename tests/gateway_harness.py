"""A real `fleet serve` process for the gateway tests (settings as FLEET_* like the workers'); the
process helpers live in ecosystem.local.gateway."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from ecosystem.local import gateway as local_gateway
from ecosystem.local.gateway import GatewayProcess, wait_until_healthy
from tests.harness import ROOT

__all__ = ["GatewayProcess", "Gateways", "start_gateway", "wait_until_healthy"]


def start_gateway(redis_url: str, log_dir: Path, *, port: int | None = None, name: str = "gateway",
                  **settings: Any) -> GatewayProcess:
    """`fleet serve` on a free port (or `port`), run from the repository root."""
    return local_gateway.start_gateway(redis_url, log_dir, port=port, name=name, cwd=ROOT, **settings)


class Gateways:
    """`gateways.start(**settings)` in a test; `close()` kills every gateway it started."""

    def __init__(self, redis_url: str, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.started: list[GatewayProcess] = []

    def start(self, **settings: Any) -> GatewayProcess:
        gw = start_gateway(self.redis_url, self.log_dir, name=f"gateway{len(self.started)}", **settings)
        self.started.append(gw)
        return gw

    def close(self) -> None:
        for gw in self.started:
            if gw.alive():
                gw.stop(signal.SIGKILL)
