"""The gateway in process: `fleet serve`'s real ASGI app (dispatcher.gateway.app.create_app) served
by uvicorn on a thread of the test process, on a free port, over the test's real Redis; and a real
worker assembly (worker.main.run_worker) on the fake engine on a thread beside it, status hash,
heartbeat and reaper included, so the gateway sees a live worker as it sees a `fleet worker`.

For tests whose subject is the gateway's answer (a status code, a refusal, a header, a body) rather
than the `fleet serve` or `fleet worker` process: no interpreter start, no import of the app per
test. Tests about the process (signals, restarts, its socket limits, its environment) start one
with the `gateways` fixture.

Settings are given as the process fixtures take them (`gateway__api_keys=[...]`,
`backend__step_delay=0.5`) and read over the same worker-config.json."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn

from backends.contract.keys import worker_key
from backends.contract.settings import load
from dispatcher.gateway.app import create_app
from dispatcher.gateway.settings import ServeSettings
from ecosystem.local.processes import free_port, redis_from_url
from worker import main as worker_main
from worker.inprocess import worker_client
from worker.serving.loop import FleetWorker
from worker.settings import FleetSettings

STARTUP_S = 30.0  # generous: a thread on a busy core, not a CPU-speed bound


def nested(settings: dict[str, Any]) -> dict[str, Any]:
    """`gateway__api_keys=[...]` as the process takes it (FLEET_GATEWAY__API_KEYS) -> nested dicts."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        *path, last = key.split("__")
        into = out
        for part in path:
            into = into.setdefault(part, {})
        into[last] = value
    return out


def _wait(ready: Any, what: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up within {STARTUP_S:g}s")
        time.sleep(0.02)


class LogBook(logging.Handler):
    """What this process logs while the tier runs, formatted as `fleet serve` writes its log
    (tracebacks included): an in-process gateway's `output()`."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class InProcessGateway:
    """`.url`, `.port`, `alive()`, `output()`, `stop()` as a GatewayProcess's; `.settings` the
    ServeSettings its app was made with."""

    url: str
    port: int
    settings: ServeSettings
    server: uvicorn.Server
    thread: threading.Thread
    log: LogBook = field(default_factory=LogBook)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def output(self) -> str:
        """Every record logged in this process while the gateway ran (its log, and the test's
        threads' beside it)."""
        return self.log.text()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def serve_inprocess(redis_url: str, log: LogBook, **settings: Any) -> InProcessGateway:
    """The gateway's app on uvicorn in a thread of this process; returns once it answers HTTP."""
    s = load(ServeSettings, None, **{**nested(settings), "redis_url": redis_url})
    port = free_port()
    # log_config None: uvicorn leaves logging alone, so its records reach the test's (caplog)
    config = uvicorn.Config(create_app(s), host="127.0.0.1", port=port, log_config=None,
                            server_header=False, lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"gateway-{port}", daemon=True)
    thread.start()
    gw = InProcessGateway(f"http://127.0.0.1:{port}", port, s, server, thread, log)

    def answers() -> bool:
        if not thread.is_alive():
            raise RuntimeError("the in-process gateway's server thread ended")
        try:
            return server.started and httpx.get(f"{gw.url}/api/version", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(answers, "the in-process gateway")
    return gw


@dataclass
class InProcessWorker:
    """worker.main.run_worker on the fake engine, on a thread: stop() drains it as SIGTERM would."""

    name: str
    thread: threading.Thread
    loop: list[FleetWorker] = field(default_factory=list)
    error: list[BaseException] = field(default_factory=list)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        for fw in self.loop:
            fw.stop()
        self.thread.join(30)


def fake_worker_thread(redis_url: str, name: str, **settings: Any) -> InProcessWorker:
    """A worker on the fake engine (`backend__slots=4` etc. as `workers.start` takes them), run by
    the worker's own assembly in a thread; returns once its status key is up."""
    given = nested(settings)
    given["backend"] = {"type": "fake", **given.get("backend", {})}
    s = load(FleetSettings, None, **{**given, "redis_url": redis_url, "name": name})
    thread = threading.Thread(name=f"worker-{name}", daemon=True, target=lambda: run(s, w))
    w = InProcessWorker(name, thread)
    _OWNERS[thread] = w
    thread.start()
    r = redis_from_url(redis_url)

    def up() -> bool:
        if w.error:
            raise RuntimeError(f"in-process worker {name} failed: {w.error[0]!r}")
        return bool(r.exists(worker_key(name))) and bool(w.loop)

    _wait(up, f"in-process worker {name}")
    return w


def run(settings: FleetSettings, w: InProcessWorker) -> None:
    try:
        worker_main.run_worker(settings, worker_client(settings.redis_url))
    except BaseException as e:  # reported to the test by fake_worker_thread / the fixture
        w.error.append(e)
    finally:
        _OWNERS.pop(threading.current_thread(), None)


_OWNERS: dict[threading.Thread, InProcessWorker] = {}  # a worker thread -> its worker


class InProcessFleet:
    """The `inprocess_gateway` fixture: `.start(**settings)` a gateway, `.worker(name, **settings)`
    a fake-engine worker; everything is stopped at the end of the test."""

    def __init__(self, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.redis_url = redis_url
        self.workers: list[InProcessWorker] = []
        self.gateways: list[InProcessGateway] = []
        self.log = LogBook()
        root = logging.getLogger()
        root.addHandler(self.log)
        monkeypatch.setattr(root, "level", min(root.level, logging.INFO))  # what `fleet serve` logs
        original = FleetWorker.install_signal_handlers

        def install_signal_handlers(fw: FleetWorker) -> None:
            # signals belong to the main thread: a loop on our thread is stopped by stop()
            owner = _OWNERS.get(threading.current_thread())
            if owner is None:
                original(fw)
            else:
                owner.loop.append(fw)

        monkeypatch.setattr(FleetWorker, "install_signal_handlers", install_signal_handlers)

    def start(self, *, over: str | None = None, **settings: Any) -> InProcessGateway:
        """A gateway with `settings` over this test's Redis, or `over` another's (the shared real
        fleet's `redis_url`: its worker answers; the test isolates by job id, as there)."""
        gw = serve_inprocess(over or self.redis_url, self.log, **settings)
        self.gateways.append(gw)
        return gw

    def worker(self, name: str, **settings: Any) -> InProcessWorker:
        w = fake_worker_thread(self.redis_url, name, **settings)
        self.workers.append(w)
        return w

    def close(self) -> None:
        with ExitStack() as stack:
            for gw in self.gateways:
                stack.callback(gw.stop)
            for w in self.workers:
                stack.callback(w.stop)
            stack.callback(logging.getLogger().removeHandler, self.log)
        errors = [e for w in self.workers for e in w.error]
        assert not errors, f"an in-process worker failed: {errors!r}"
