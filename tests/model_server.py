"""A real HTTP server for a model file (http.server in a thread): Range requests as Hugging Face's
CDN answers them, and faults a test asks for: a transfer cut after some bytes, a slow body, a
size no disk holds. Every request is recorded (path, Range header, bytes sent)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HUGE = 1 << 50  # a Content-Length no test disk has room for


@dataclass
class Served:
    path: str
    range: str | None
    sent: int = 0


@dataclass
class ModelServer:
    files: dict[str, Path]  # URL path -> file served
    url: str = ""
    cut_after: dict[str, int] = field(default_factory=dict)  # URL path -> bytes before one cut
    pause: float = 0.0  # seconds between chunks: a slow server
    requests: list[Served] = field(default_factory=list)


CHUNK = 1 << 16


def handler_for(server: ModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            if self.path.startswith("/redirect/"):  # Hugging Face's resolve URLs redirect to a CDN
                self.send_response(302)
                self.send_header("Location", self.path.removeprefix("/redirect"))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            record = Served(self.path, self.headers.get("Range"))
            server.requests.append(record)
            if self.path == "/huge.gguf":
                self.send_response(200)
                self.send_header("Content-Length", str(HUGE))
                self.end_headers()
                return
            file = server.files.get(self.path)
            if file is None:
                self.send_error(404)
                return
            size = file.stat().st_size
            start = 0
            match = re.fullmatch(r"bytes=(\d+)-", record.range or "")
            if match:
                start = int(match.group(1))
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(size - start))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            cut = server.cut_after.pop(self.path, None)
            with open(file, "rb") as f:
                f.seek(start)
                while chunk := f.read(CHUNK):
                    if cut is not None and record.sent + len(chunk) > cut:
                        self.wfile.write(chunk[: cut - record.sent])
                        record.sent = cut
                        self.wfile.flush()
                        self.close_connection = True
                        return  # the connection closes with the body short: a cut transfer
                    self.wfile.write(chunk)
                    record.sent += len(chunk)
                    if server.pause:
                        time.sleep(server.pause)

    return Handler


@contextmanager
def model_server(files: dict[str, Path]) -> Iterator[ModelServer]:
    state = ModelServer(files)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    httpd.daemon_threads = True
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
