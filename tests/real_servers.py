"""Real servers for the HTTP-backend tests: a llama-server process (built by
scripts/build-llama-server, cached) and the in-process Ollama-API test server, both on the real model.

FLEET_TEST_THREADS sets llama-server's -t (default 2); on a box busy compiling, 1 avoids ggml's
spinning thread barriers fighting for the two cores."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from backends.model import default_model_path
from dispatcher.local import ROOT, free_port

__all__ = ["ROOT", "LlamaServer", "free_port", "llama_server", "llama_server_binary", "model_path"]


def model_path() -> Path:
    return default_model_path()


def llama_server_binary() -> Path:
    """Build once (minutes), then the cached path (instant)."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "build-llama-server")], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"scripts/build-llama-server failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass
class LlamaServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL, like a crash: no goodbye to open streams."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llama-server not healthy after {timeout}s: {self.log.read_text()[-2000:]}")


@contextmanager
def llama_server(
    log_dir: Path, parallel: int = 4, ctx: int = 4096, wait: bool = True
) -> Iterator[LlamaServer]:
    port = free_port()
    log = log_dir / f"llama-server-{port}.log"
    args = [str(llama_server_binary()), "-m", str(model_path()), "--parallel", str(parallel), "-c", str(ctx)]
    threads = os.environ.get("FLEET_TEST_THREADS", "2")
    args += ["--host", "127.0.0.1", "--port", str(port), "-t", threads, "--slots"]
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    server = LlamaServer(f"http://127.0.0.1:{port}", process, log)
    try:
        if wait:
            server.wait_healthy()
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
