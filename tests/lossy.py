"""Test helpers for issue 10's defects: a TCP proxy in front of a real redis-server that loses the
reply to a chosen command (the command reaches Redis and applies; the client's connection is cut
before the reply), and in-process workers on the fake engine driven turn by turn."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from redis import Redis

from backends.contract.keys import worker_key
from backends.fake import FakeBackend
from worker.loop import FleetWorker
from worker.settings import FleetSettings


class LossyProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._rules: list[list[Any]] = []  # [pattern, times left]
        self._lock = threading.Lock()
        self.lost = 0  # replies lost so far
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lose_reply(self, pattern: bytes, times: int = 1) -> None:
        """The next `times` client writes containing `pattern` reach Redis; their replies do not."""
        with self._lock:
            self._rules.append([pattern, times])

    def _match(self, data: bytes) -> bool:
        with self._lock:
            for rule in self._rules:
                if rule[1] > 0 and rule[0] in data:
                    rule[1] -= 1
                    return True
        return False

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            cut = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, cut), daemon=True).start()
            threading.Thread(target=self._down, args=(client, upstream, cut), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, cut: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                if self._match(data):
                    cut.set()  # before forwarding: the reply must never reach the client
                upstream.sendall(data)
        except OSError:
            pass
        _close(client, upstream)

    def _down(self, client: socket.socket, upstream: socket.socket, cut: threading.Event) -> None:
        try:
            while data := upstream.recv(65536):
                if cut.is_set():
                    with self._lock:
                        self.lost += 1
                    break
                client.sendall(data)
        except OSError:
            pass
        _close(client, upstream)

    def close(self) -> None:
        self._closed = True
        self.listener.close()


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


def worker_client(url: str) -> Redis:
    """A client made the way `fleet worker` makes its own (dispatcher/cli.py), redis-py's default
    retries included."""
    return Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10, socket_keepalive=True,
                          health_check_interval=30)


def inproc_worker(url: str, name: str, *, slots: int = 4, fail_after: int | None = None,
                  alive: Redis | None = None, **settings: Any) -> FleetWorker:
    """A FleetWorker on the fake engine, in this process. `alive`: mark it live in Redis (its
    status key), as its heartbeat would."""
    s = FleetSettings(redis_url=url, name=name, backend={"type": "fake", "slots": slots}, **settings)
    fw = FleetWorker(s, FakeBackend(s.backend, fail_after=fail_after), worker_client(url), name)
    if alive is not None:
        alive.set(worker_key(name), "{}", px=600_000)
    return fw


def run_until(workers: list[FleetWorker], done: Callable[[], Any], timeout: float = 30,
              what: str = "") -> Any:
    """Turn the workers' loops (one turn each, in order) until `done()` is truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for fw in workers:
            fw.run_once()
        value = done()
        if value:
            return value
    raise TimeoutError(f"timed out after {timeout}s waiting for {what or done}")


def long_prompt(words: int) -> str:
    return " ".join(f"w{i}" for i in range(words))
