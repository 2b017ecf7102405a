"""A local fleet from real processes: a private redis-server, `fleet worker` and `fleet serve`
subprocesses. Used by `scripts/demo`, `fleet bench` and the integration tests. Workers read the
config the caller names, else the one this process would read (FLEET_CONFIG or
./worker-config.json).

    with RedisServer.start(tmp) as rs:                      # redis-server on a free loopback port
        w = start_worker(rs.url, "w1", logs, backend__slots=4)  # a real `fleet worker` process
        ...
        w.stop()                                             # SIGTERM (drain), wait
        gw = start_gateway(rs.url, logs)                     # `fleet serve` on a free port
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis import Redis

from backends.contract.connect import redis_from_url
from backends.contract.keys import worker_key
from backends.contract.settings import config_path
from ecosystem.private_redis import redis_server_binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    port: int
    dir: Path
    process: subprocess.Popen[bytes]
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, dir: Path, port: int | None = None, extra: list[str] | None = None) -> RedisServer:
        port = port or free_port()
        dir.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(dir),
                "--save", "", "--appendonly", "no", *(extra or [])]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = cls(port, dir, proc, list(extra or []))
        wait_for(lambda: _pings(server.url), 10, "redis-server to start")
        return server

    def client(self) -> Redis:
        return redis_from_url(self.url)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(10)

    def restart(self, sig: int = signal.SIGTERM, down_for: float = 0.0) -> None:
        """Stop (SIGTERM: a clean shutdown; SIGKILL: a crash) and start again on the same port and
        directory, so an AOF brings back what it held; `down_for` seconds in between."""
        self.stop(sig)
        time.sleep(down_for)
        again = RedisServer.start(self.dir, self.port, self.extra)
        self.process = again.process

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(signal.SIGKILL)


def _pings(url: str) -> bool:
    try:
        return bool(redis_from_url(url, socket_connect_timeout=0.5).ping())
    except Exception:
        return False


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class WorkerProcess:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def worker_env(redis_url: str, name: str, *, config: Path | None = None, **settings: Any) -> dict[str, str]:
    """Environment for a worker: FLEET_* overrides; nested keys with __ (backend__slots=4).
    `config`: the worker-config.json to read (default: this process's, see config_path())."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"FLEET_REDIS_URL": redis_url, "FLEET_NAME": name, "PYTHONUNBUFFERED": "1"})
    config = config or config_path()
    if config is not None:
        env["FLEET_CONFIG"] = str(config.resolve())
    for key, value in settings.items():
        env["FLEET_" + key.upper()] = value if isinstance(value, str) else _json(value)
    return env


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def start_worker(redis_url: str, name: str, log_dir: Path, *, wait: bool = True, timeout: float = 90,
                 args: list[str] | None = None, config: Path | None = None, **settings: Any) -> WorkerProcess:
    """Start `fleet worker` as its own process; wait until its status key appears."""
    log = log_dir / f"{name}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ecosystem.cli", "worker", *(args or [])],
        env=worker_env(redis_url, name, config=config, **settings),
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    w = WorkerProcess(name, proc, log)
    if wait:
        r = redis_from_url(redis_url)

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {name} exited ({proc.returncode}):\n{w.output()[-3000:]}")
            return bool(r.exists(worker_key(name)))

        wait_for(up, timeout, f"worker {name} to register")
    return w


@dataclass
class GatewayProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.alive():
            self.process.send_signal(sig)
        return self.process.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_gateway(redis_url: str, log_dir: Path, *, port: int | None = None, name: str = "gateway",
                  cwd: Path | None = None, config: Path | None = None, timeout: float = 30,
                  **settings: Any) -> GatewayProcess:
    """`fleet serve` on a free port (or `port`), settings as FLEET_* like a worker's, `config` the
    worker-config.json it reads (default: this process's); returns once it answers HTTP."""
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    env = worker_env(redis_url, name, config=config, **settings)
    proc = subprocess.Popen([sys.executable, "-m", "ecosystem.cli", "serve", "--port", str(port)],
                            env=env, cwd=cwd, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    gw = GatewayProcess(f"http://127.0.0.1:{port}", port, proc, log)

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"fleet serve exited ({proc.returncode}):\n{gw.output()[-3000:]}")
        try:
            return httpx.get(f"{gw.url}/api/version", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, timeout, "fleet serve to answer")
    return gw


def wait_until_healthy(gw: GatewayProcess, timeout: float = 30) -> None:
    wait_for(lambda: httpx.get(f"{gw.url}/health", timeout=2).status_code == 200, timeout,
             "the gateway to see a live worker")
