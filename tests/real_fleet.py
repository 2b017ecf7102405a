"""One real fleet a test session shares: its own redis-server that no test flushes, one real
`fleet worker` on the embedded model and one `fleet serve` at default settings, started the first
time a test asks for it. For the many tests that need only "the real model answers through a real
gateway": they isolate by job id, tenant or pool, never by flushing, and never kill or reconfigure
these processes (tests about a process's life start their own with the `workers` and `gateways`
fixtures)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis import Redis

from ecosystem.local.processes import GatewayProcess, RedisServer, WorkerProcess, wait_until_healthy
from tests.gateway_harness import start_gateway
from tests.harness import start_worker

SLOTS = 4  # the most jobs a shared-fleet test may expect to run at once


@dataclass
class RealFleet:
    redis_url: str
    worker: WorkerProcess
    gateway: GatewayProcess

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return self.gateway.url

    def redis(self) -> Redis:
        return Redis.from_url(self.redis_url)

    def check_serving(self) -> None:
        """Both processes alive: a test that killed or wedged them fails, not the next one."""
        for process in (self.worker, self.gateway):
            assert process.alive(), f"a test stopped the shared fleet:\n{process.output()[-3000:]}"


@contextmanager
def fleet_processes(dir: Path, name: str, worker: dict[str, Any],
                    gateway: dict[str, Any] | None = None) -> Iterator[RealFleet]:
    """A real worker (`worker`: its settings) and a `fleet serve` (`gateway`: its settings) on a
    redis-server of their own, named `name`: the session's shared fleet, or a module's where its
    tests share settings the default fleet lacks (a catalogue, a template)."""
    with RedisServer.start(dir / "redis") as server:
        started = start_worker(server.url, f"{name}-w1", dir / "logs", **worker)
        gw = start_gateway(server.url, dir / "logs", name=f"{name}-gateway", **(gateway or {}))
        try:
            wait_until_healthy(gw)
            yield RealFleet(server.url, started, gw)
        finally:
            gw.stop(signal.SIGKILL)
            started.kill()


def real_fleet_processes(dir: Path) -> AbstractContextManager[RealFleet]:
    return fleet_processes(dir, "shared", {"backend__slots": SLOTS})
