"""One real fleet a test session shares: its own redis-server that no test flushes, one real
`fleet worker` on the embedded model and one `fleet serve` at default settings, started the first
time a test asks for it. For the many tests that need only "the real model answers through a real
gateway": they isolate by job id, tenant or pool, never by flushing, and never kill or reconfigure
these processes (tests about a process's life start their own with the `workers` and `gateways`
fixtures)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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
def real_fleet_processes(dir: Path) -> Iterator[RealFleet]:
    with RedisServer.start(dir / "redis") as server:
        worker = start_worker(server.url, "shared-w1", dir / "logs", backend__slots=SLOTS)
        gateway = start_gateway(server.url, dir / "logs", name="shared-gateway")
        try:
            wait_until_healthy(gateway)
            yield RealFleet(server.url, worker, gateway)
        finally:
            gateway.stop(signal.SIGKILL)
            worker.kill()
