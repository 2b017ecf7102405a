"""A real `fleet serve` process for the gateway tests (settings as FLEET_* like the workers'; the
process helpers live in ecosystem.local.processes)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from ecosystem.local import processes
from ecosystem.local.processes import GatewayProcess, wait_until_healthy
from tests.harness import ROOT

__all__ = ["GatewayProcess", "Gateways", "start_gateway", "wait_until_healthy"]


def start_gateway(redis_url: str, log_dir: Path, **kw: Any) -> GatewayProcess:
    """`fleet serve` on a free port, run from the repository root; returns once it answers HTTP."""
    return processes.start_gateway(redis_url, log_dir, cwd=ROOT, **kw)


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
