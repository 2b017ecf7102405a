"""The soak's fleet, from real processes: a private redis-server with AOF (or, for the failover
phase, a Sentinel-managed primary and replica), `fleet worker` processes each behind its own
LinkProxy, and `fleet serve` gateways on fixed ports (a restarted gateway answers where its
clients already send).

Every process it starts is stopped in `close()`. A process killed by a fault is started again
under the same name (its log goes to a new file per incarnation, so a crash's last lines stay).
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
from redis import Redis

from backends.contract.connect import redis_from_url
from backends.contract.keys import worker_key
from backends.contract.replies import as_str
from ecosystem.local.processes import (
    GatewayProcess,
    RedisServer,
    WorkerProcess,
    free_port,
    start_gateway,
    start_worker,
    wait_for,
)
from ecosystem.local.sentinel import SentinelCluster
from ecosystem.soak.plan import FleetConfig, SoakPlan
from ecosystem.soak.proxy import LinkProxy

# appendfsync always: a kill -9 of Redis loses nothing it acknowledged (docs/reliability.md,
# "Redis outages"), so every job a client was told about must still be there afterwards
AOF = ["--appendonly", "yes", "--appendfsync", "always"]
NAME_TAKEN = "is already registered"  # worker/main.py's refusal of a name whose status key lives


class RedisSide(Protocol):
    url: str

    def client(self) -> Redis: ...

    def worker_url(self, name: str) -> str: ...

    def close(self) -> None: ...


class SingleRedis:
    """One redis-server with AOF; each worker reaches it through its own LinkProxy."""

    def __init__(self, dir: Path) -> None:
        self.server = RedisServer.start(dir, extra=AOF)
        self.url = self.server.url
        self.proxies: dict[str, LinkProxy] = {}

    def client(self) -> Redis:
        return redis_from_url(self.url, socket_timeout=10)

    def worker_url(self, name: str) -> str:
        if name not in self.proxies:
            self.proxies[name] = LinkProxy(self.server.port)
        return self.proxies[name].url

    def restart(self, sig: int, down_for: float) -> None:
        self.server.restart(sig, down_for)

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        self.server.stop(signal.SIGKILL)


class SentinelRedis:
    """A primary, a replica and three Sentinels (ecosystem/local/sentinel.py); workers and
    gateways connect through `redis+sentinel://`, so a failover needs no restart anywhere."""

    def __init__(self, dir: Path) -> None:
        self.cluster = SentinelCluster.start(dir)
        self.url = self.cluster.url

    def client(self) -> Redis:
        return redis_from_url(self.url, socket_timeout=10)

    def worker_url(self, name: str) -> str:
        return self.url

    def close(self) -> None:
        self.cluster.stop()


@dataclass
class Incarnations:
    """How often each process was started (1 = never restarted), and when it last was."""

    count: dict[str, int] = field(default_factory=dict)
    started_at: dict[str, float] = field(default_factory=dict)

    def next(self, name: str) -> int:
        self.count[name] = self.count.get(name, 0) + 1
        self.started_at[name] = time.monotonic()
        return self.count[name]


class SoakFleet:
    def __init__(self, plan: SoakPlan, redis: RedisSide, phase: str) -> None:
        self.plan = plan
        self.redis = redis
        self.phase = phase
        self.dir = plan.run_dir / phase
        self.config = FleetConfig(plan, redis.url)
        self.config.path = self.dir / "worker-config.json"
        self.config.write()
        self.workers: dict[str, WorkerProcess] = {}
        self.gateways: list[GatewayProcess] = []
        self.gateway_ports = [free_port() for _ in range(plan.gateways)]
        self.incarnations = Incarnations()
        self.name_taken: dict[str, int] = {}  # restarts refused while a dead predecessor's key lived

    # -- names and settings -----------------------------------------------------------------------

    @property
    def worker_names(self) -> list[str]:
        return [f"{self.phase}-w{i + 1}" for i in range(self.plan.workers)]

    def gateway_name(self, index: int) -> str:
        return f"{self.phase}-gateway{index}"

    def gateway_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.gateway_ports[index]}"

    def request_timeout(self, index: int) -> float:
        """Gateway 1 is the short-timeout path: its requests answer 504 after a few seconds."""
        return self.plan.short_timeout if index == 1 else self.plan.long_timeout

    def _log_dir(self, name: str) -> Path:
        return self.dir / "logs" / f"{name}.{self.incarnations.count.get(name, 0)}"

    # -- start and stop -----------------------------------------------------------------------------

    def start(self) -> None:
        starting = [self.start_worker(name, wait=False) for name in self.worker_names]
        for w in starting:
            self.wait_registered(w.name)
        for i in range(self.plan.gateways):
            self.start_gateway(i)
        for i in range(self.plan.gateways):
            self.wait_healthy(i)

    def start_worker(self, name: str, *, wait: bool = True) -> WorkerProcess:
        """Start the worker; with `wait`, as a supervisor restarts one: a worker whose killed
        predecessor's status key has not expired yet exits at once (its name looks taken), and
        is started again until it runs (the number of such refusals is kept in `name_taken`)."""
        deadline = time.monotonic() + 3 * self.plan.heartbeat_ttl + 10
        while True:
            self.incarnations.next(name)
            w = start_worker(self.redis.worker_url(name), name, self._log_dir(name), wait=False,
                             config=self.config.path)
            self.workers[name] = w
            if not wait:
                return w
            try:
                self.wait_registered(name)
                return w
            except RuntimeError:
                if w.alive() or NAME_TAKEN not in w.output() or time.monotonic() > deadline:
                    raise
                self.name_taken[name] = self.name_taken.get(name, 0) + 1
                time.sleep(0.5)

    def wait_registered(self, name: str) -> None:
        w = self.workers[name]
        r = self.redis.client()

        def up() -> bool:
            if not w.alive():
                raise RuntimeError(f"worker {name} exited ({w.process.returncode}):\n{w.output()[-3000:]}")
            # this process's own status: a killed one's key outlives it by up to its TTL
            with contextlib.suppress(Exception):
                return as_str(r.hget(worker_key(name), "pid")) == str(w.process.pid)
            return False

        wait_for(up, 60 if self.plan.fake else 240, f"worker {name} to register", interval=0.1)

    def start_gateway(self, index: int) -> GatewayProcess:
        name = self.gateway_name(index)
        self.incarnations.next(name)
        gw = start_gateway(self.redis.url, self._log_dir(name), port=self.gateway_ports[index], name=name,
                           config=self.config.path, timeout=60,
                           gateway__request_timeout=self.request_timeout(index))
        if index < len(self.gateways):
            self.gateways[index] = gw
        else:
            self.gateways.append(gw)
        return gw

    def wait_healthy(self, index: int, timeout: float = 60) -> None:
        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.gateway_url(index)}/health", timeout=2).status_code == 200
            return False

        wait_for(healthy, timeout, f"gateway {index} to see a live worker", interval=0.2)

    def kill_worker(self, name: str, sig: int = signal.SIGKILL, timeout: float = 60) -> int:
        """Signal the worker and wait for it to exit; its return code."""
        return self.workers[name].stop(sig, timeout=timeout)

    def kill_gateway(self, index: int) -> None:
        self.gateways[index].stop(signal.SIGKILL)

    def pause_workers(self, names: list[str]) -> None:
        for name in names:
            self.workers[name].process.send_signal(signal.SIGSTOP)

    def resume_workers(self, names: list[str]) -> None:
        for name in names:
            self.workers[name].process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        for gw in self.gateways:
            if gw.alive():
                with contextlib.suppress(Exception):
                    gw.stop(signal.SIGKILL)
        for w in self.workers.values():
            if w.alive():
                with contextlib.suppress(Exception):
                    w.process.send_signal(signal.SIGCONT)  # a paused worker cannot die of SIGTERM
                    w.stop(signal.SIGKILL)
        self.redis.close()
