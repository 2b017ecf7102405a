"""Hosts as Linux network namespaces, for multi-host tests on one machine (needs root).

    with NetLab(["h1", "h2"]) as lab:             # namespaces <prefix>redis, <prefix>h1, <prefix>h2
        lab.run("h1", ["ping", "-c1", lab.redis_ip("h1")])
        lab.cut("h1"); ...; lab.restore("h1")      # the h1 <-> redis link down / up

Layout: Redis's namespace is joined to each host's namespace by its own veth pair on a private
/24 (10.<net>.<i>.0/24: redis end .1, host end .2), so cutting one host's link leaves the others
alone. Addresses exist only inside the lab's namespaces; nothing is routed out of the machine,
and the root namespace gets no address at all: the test process reaches Redis through a unix
socket on the shared filesystem (`RedisInNamespace.unix_url`).

Teardown always runs (context manager; processes started with `popen` are killed first), and a
new lab first deletes namespaces left by an earlier lab whose process is gone (names carry the
owner's pid after PREFIX).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from redis import Redis

from ecosystem.local.processes import wait_for
from ecosystem.private_redis import redis_server_binary

PREFIX = "lfnet"  # every lab namespace is lfnet<pid>-<role>
REDIS_PORT = 6379


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def namespaces() -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    return psutil.pid_exists(pid)


def remove_stale() -> list[str]:
    """Delete lab namespaces whose owning process no longer exists (a killed earlier run)."""
    removed = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _kill_namespace_processes(ns)
            _ip("netns", "delete", ns, check=False)
            removed.append(ns)
    return removed


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@dataclass
class NetLab:
    hosts: Sequence[str]
    net: int = field(default_factory=lambda: random.randint(100, 250))  # 10.<net>.x.y
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.created: list[str] = []

    def ns(self, role: str) -> str:
        return self.prefix + role

    def redis_ip(self, host: str) -> str:
        """Redis's address as seen from `host`."""
        return f"10.{self.net}.{self._index(host)}.1"

    def host_ip(self, host: str) -> str:
        return f"10.{self.net}.{self._index(host)}.2"

    def _index(self, host: str) -> int:
        return list(self.hosts).index(host) + 1

    def __enter__(self) -> NetLab:
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _build(self) -> None:
        for role in ("redis", *self.hosts):
            _ip("netns", "add", self.ns(role))
            self.created.append(self.ns(role))
            _ip("-n", self.ns(role), "link", "set", "lo", "up")
        for host in self.hosts:
            # one veth pair per host, created straight into the two namespaces (names are local to them)
            _ip("link", "add", f"to-{host}", "netns", self.ns("redis"), "type", "veth",
                "peer", "name", "to-redis", "netns", self.ns(host))
            _ip("-n", self.ns("redis"), "addr", "add", f"{self.redis_ip(host)}/24", "dev", f"to-{host}")
            _ip("-n", self.ns(host), "addr", "add", f"{self.host_ip(host)}/24", "dev", "to-redis")
            _ip("-n", self.ns("redis"), "link", "set", f"to-{host}", "up")
            _ip("-n", self.ns(host), "link", "set", "to-redis", "up")

    def cut(self, host: str) -> None:
        """Take the host's link down on both ends: packets are dropped, connections stay half-open."""
        _ip("-n", self.ns("redis"), "link", "set", f"to-{host}", "down")
        _ip("-n", self.ns(host), "link", "set", "to-redis", "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.ns("redis"), "link", "set", f"to-{host}", "up")
        _ip("-n", self.ns(host), "link", "set", "to-redis", "up")

    def command(self, role: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(role), *argv]

    def run(self, role: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(role, argv), capture_output=True, text=True, **kw)

    def popen(self, role: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        """A process inside the namespace; killed at teardown if still running."""
        proc = subprocess.Popen(self.command(role, argv), **kw)
        self.procs.append(proc)
        return proc

    def teardown(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for ns in reversed(self.created):
            _kill_namespace_processes(ns)
            _ip("netns", "delete", ns, check=False)  # deleting a namespace removes its veth ends
        self.created.clear()


@dataclass
class RedisInNamespace:
    """redis-server inside the lab's redis namespace: TCP on every lab link, plus a unix socket
    for the test process in the root namespace."""

    lab: NetLab
    dir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.dir / "redis.sock"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def url_from(self, host: str) -> str:
        return f"redis://{self.lab.redis_ip(host)}:{REDIS_PORT}/0"

    def start(self) -> RedisInNamespace:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), "--port", str(REDIS_PORT), "--bind", "0.0.0.0",
                "--protected-mode", "no", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no"]
        self.process = self.lab.popen("redis", args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._pings, 10, "redis-server in its namespace")
        return self

    def _pings(self) -> bool:
        try:
            return bool(Redis.from_url(self.unix_url, socket_connect_timeout=0.5).ping())
        except Exception:
            return False


def wait_until(pred: Any, timeout: float, what: str) -> float:
    """wait_for, returning the monotonic time the condition first held."""
    wait_for(pred, timeout, what, interval=0.05)
    return time.monotonic()

