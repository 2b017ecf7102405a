"""A TCP proxy between one worker and Redis that the soak can cut and restore: the worker's own
network link, without network namespaces (which need root).

While cut, the link is a black hole, as a pulled cable or a dead switch port is: connections stay
open and new ones are accepted, but no byte passes either way, so the worker's commands hang
until its socket timeout and its heartbeat key expires. Restoring drops every connection that
lived through the cut (as a router's reboot would), so the worker reconnects at once instead of
finding a byte stream with a gap in it.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class LinkProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        self._pairs: list[tuple[socket.socket, socket.socket | None]] = []
        threading.Thread(target=self._accept, daemon=True, name=f"link-proxy-{self.port}").start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        with self._lock:
            self._cut = True

    def restore(self) -> None:
        with self._lock:
            self._cut = False
            pairs, self._pairs = self._pairs, []
        for client, upstream in pairs:
            _close(client, upstream)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        self.restore()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream: socket.socket | None = None
            if not self._cut:
                try:
                    upstream = socket.create_connection(self.upstream, timeout=2)
                    upstream.settimeout(None)
                except OSError:  # Redis itself is down: the worker sees a refused connection
                    _close(client)
                    continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket | None) -> None:
        try:
            while data := src.recv(65536):
                if self._cut or dst is None:
                    continue  # the black hole: read and dropped, never answered
                dst.sendall(data)
        except OSError:
            pass
        _close(src, dst)
        with self._lock:
            self._pairs = [p for p in self._pairs if src not in p]


def _close(*socks: socket.socket | None) -> None:
    for s in socks:
        if s is None:
            continue
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()
