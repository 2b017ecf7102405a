"""A local `fleet serve` process (the HTTP gateway) on a fleet's Redis, for `fleet bench --via http`
and the tests; settings as FLEET_* like the workers' (`worker_env`).

    gw = start_gateway(redis.url, logs)         # a free loopback port; returns once it answers
    wait_until_healthy(gw)                       # ... and sees a live worker
    httpx.post(f"{gw.url}/v1/completions", json={...})
    gw.stop()
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ecosystem.local.processes import free_port, wait_for, worker_env


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
                  cwd: Path | None = None, **settings: Any) -> GatewayProcess:
    """`fleet serve` on a free port (or `port`); returns once it answers HTTP."""
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    env = worker_env(redis_url, name, **settings)
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

    wait_for(answers, 30, "fleet serve to answer")
    return gw


def wait_until_healthy(gw: GatewayProcess, timeout: float = 30) -> None:
    wait_for(lambda: httpx.get(f"{gw.url}/health", timeout=2).status_code == 200, timeout,
             "the gateway to see a live worker")
