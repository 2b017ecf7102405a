"""A real Redis Sentinel setup on one host: 1 primary, 1 replica, 3 Sentinels (`redis-server
--sentinel`, the same Debian binary), all on loopback with free ports, always torn down. The
data servers keep an AOF, as under Sentinel they must (docs/scale-out.md). Used by the Sentinel
tests and `fleet soak`'s failover phase.

    with SentinelCluster.start(tmp) as sc:
        url = sc.url                       # redis+sentinel://127.0.0.1:a,127.0.0.1:b,127.0.0.1:c/fleet/0
        sc.kill_primary()                  # kill -9; the Sentinels promote the replica
"""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis

from ecosystem.local.processes import free_port, wait_for
from ecosystem.private_redis import redis_server_binary

SERVICE = "fleet"
DOWN_AFTER_MS = 1000  # how long a primary may be silent before a Sentinel calls it down


@dataclass
class SentinelCluster:
    dir: Path
    data_ports: list[int] = field(default_factory=list)  # [primary, replica] at start
    sentinel_ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    @classmethod
    def start(cls, dir: Path) -> SentinelCluster:
        sc = cls(dir)
        try:
            sc._start()
        except BaseException:
            sc.stop()
            raise
        return sc

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        primary, replica = free_port(), free_port()
        self.data_ports = [primary, replica]
        self._data(primary, [])
        self._data(replica, ["--replicaof", "127.0.0.1", str(primary)])
        wait_for(lambda: self._role(replica) == "in sync", 20, "the replica to sync")
        for _ in range(3):
            port = free_port()
            self.sentinel_ports.append(port)
            conf = self.dir / f"sentinel-{port}.conf"  # Sentinel rewrites its config: one file each
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {self.dir}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2",
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {SERVICE} 10000",
                f"sentinel parallel-syncs {SERVICE} 1", ""]))
            self._spawn(port, [str(conf), "--sentinel"], f"sentinel-{port}")
        for port in self.sentinel_ports:
            wait_for(functools.partial(self._sentinel_sees_replica, port), 30,
                     f"sentinel {port} to see the replica")

    def _data(self, port: int, extra: list[str]) -> None:
        self._spawn(port, ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                           "--dbfilename", f"dump-{port}.rdb", "--save", "", "--appendonly", "yes",
                           "--appendfilename", f"aof-{port}.aof", "--appenddirname", f"aof-{port}", *extra],
                    f"redis-{port}")
        wait_for(lambda: _pings(port), 10, f"redis-server {port}")

    def _spawn(self, port: int, args: list[str], log: str) -> None:
        out = (self.dir / f"{log}.log").open("wb")
        self.procs[port] = subprocess.Popen([redis_server_binary(), *args], stdout=out,
                                            stderr=subprocess.STDOUT)

    def _role(self, port: int) -> str:
        info = Redis(port=port).info("replication")
        if info.get("role") == "master":
            return "master"
        return "in sync" if info.get("master_link_status") == "up" else "syncing"

    def _sentinel_sees_replica(self, port: int) -> bool:
        try:
            return len(Redis(port=port).sentinel_slaves(SERVICE)) >= 1
        except Exception:
            return False

    def primary_port(self) -> int:
        """The port the Sentinels now name as primary."""
        for port in self.sentinel_ports:
            with contextlib.suppress(Exception):
                addr: Any = Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(SERVICE)
                return int(addr[1])
        raise RuntimeError("no Sentinel answers")

    def kill_primary(self) -> int:
        port = self.primary_port()
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(10)
        return port

    def restart(self, port: int) -> None:
        """Bring a killed data server back on its port, as a supervisor would; the Sentinels make
        it a replica of the new primary. It comes back with its data (AOF): a server restarted
        empty can be promoted by a second failover and wipe the rest (seen here: on a loaded box a
        Sentinel called the new primary down 1 s after the switch and promoted the empty one)."""
        self._data(port, [])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)

    def __enter__(self) -> SentinelCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _pings(port: int) -> bool:
    try:
        return bool(Redis(port=port, socket_connect_timeout=0.5).ping())
    except Exception:
        return False
