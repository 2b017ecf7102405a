"""Shared fixtures: one private redis-server per test session (a fresh DB per test) and a
factory for real `fleet worker` processes that are stopped after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tests.gateway_harness import Gateways
from tests.harness import RedisServer, WorkerProcess, start_worker


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
