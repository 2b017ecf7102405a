"""Shared fixtures: one private redis-server per test session (a fresh DB per test) and a
factory for real `fleet worker` processes that are stopped after each test.

Run in parallel (`scripts/test`: pytest-xdist), each pytest worker takes one core and every
process it starts inherits it, so a model runs one thread a process: on a shared core, ggml's
thread barriers would spin against the other tests' threads and double the CPU a test takes
(measured: 97 CPU s for a 39 s test)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tests import model_guard, weights_cache
from tests.gateway_harness import Gateways
from tests.gateway_inprocess import InProcessFleet
from tests.harness import RedisServer, WorkerProcess, start_worker
from tests.real_fleet import RealFleet, real_fleet_processes


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    if worker.startswith("gw"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})
    weights_cache.install()  # under the guard: it wraps what is there
    model_guard.install()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # the shared real fleet is the real model
        if "real_fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(model_guard.MARK)
    # the longest modules first (seconds from a measured run, tests/durations.json), so the run
    # does not end on one long module while the other workers idle; a stable sort keeps each
    # module's own order and its tests together
    durations = json.loads((Path(__file__).parent / "durations.json").read_text())
    items.sort(key=lambda item: -durations.get(item.path.name, 0))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    model_guard.running(item.nodeid, item.get_closest_marker(model_guard.MARK) is not None)
    yield
    model_guard.running(item.nodeid, True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer.start(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    r = redis_server.client()
    r.flushall()
    return redis_server.url


@pytest.fixture
def redis(redis_url: str) -> Redis:
    return Redis.from_url(redis_url)


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    """Call `workers.start(name, **settings)`; every worker is killed at the end of the test."""
    started: list[WorkerProcess] = []

    class Starter(list):  # type: ignore[type-arg]
        def start(self, name: str, **settings: object) -> WorkerProcess:
            w = start_worker(redis_url, name, tmp_path / "logs", **settings)
            started.append(w)
            self.append(w)
            return w

    yield Starter()
    for w in started:
        if w.alive():
            w.kill()


@pytest.fixture
def gateways(redis_url: str, tmp_path: Path) -> Iterator[Gateways]:
    """Call `gateways.start(**settings)` for a `fleet serve` process; all are killed at the end."""
    started = Gateways(redis_url, tmp_path / "logs")
    yield started
    started.close()


@pytest.fixture(scope="session")
def shared_real_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    with real_fleet_processes(tmp_path_factory.mktemp("real-fleet")) as fleet:
        yield fleet


@pytest.fixture
def real_fleet(shared_real_fleet: RealFleet) -> Iterator[RealFleet]:
    """The session's shared real fleet (tests/real_fleet.py), checked serving before and after."""
    shared_real_fleet.check_serving()
    yield shared_real_fleet
    shared_real_fleet.check_serving()


@pytest.fixture
def inprocess_gateway(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcessFleet]:
    """The gateway tier in process (tests/gateway_inprocess.py): `inprocess_gateway.start(**settings)`
    serves the real app over this test's Redis, `.worker(name, **settings)` a fake-engine worker."""
    fleet = InProcessFleet(redis_url, monkeypatch)
    yield fleet
    fleet.close()
