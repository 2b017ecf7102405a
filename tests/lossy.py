"""Test helpers for lossy links: a TCP proxy in front of a real redis-server that loses the
reply to a chosen command (the command reaches Redis and applies; the client's connection is cut
before the reply), and a driver for in-process workers (worker/inprocess.py) turn by turn."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.inprocess import fake_worker, worker_client  # noqa: F401  (re-exported for the tests)
from worker.serving.loop import FleetWorker


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


inproc_worker = fake_worker  # the name the defect tests use


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
