"""Shared by the chaos, recovery, fuzz and security tests: what a job left in Redis (read by
ecosystem/local/records.py, which `fleet soak` shares), and workers that are always stopped at the
end of a test."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from redis import Redis

from backends.contract.keys import CAPACITY_LIVE_MS, capacity_key, inflight_key
from dispatcher import FleetJob
from ecosystem.local.processes import free_port
from ecosystem.local.records import final_entries, not_ended_once, stream_events
from ecosystem.private_redis import redis_server_binary
from tests.harness import RedisServer, WorkerProcess, start_worker, wait_for

__all__ = ["BackgroundResults", "Workers", "assert_exactly_one_final", "final_entries", "fleet_workers",
           "held", "start_guarded_redis", "stream_events", "streaming", "wait_streaming"]


def assert_exactly_one_final(redis: Redis, job_ids: list[str]) -> None:
    """One final stream entry and one RQ result per job: nothing lost, nothing finished twice."""
    problems = not_ended_once(redis, job_ids)
    assert not problems, f"{len(problems)} jobs without exactly one final result: {problems}"


def held(redis: Redis, worker: str) -> list[str]:
    return [raw.decode() for raw in redis.lrange(inflight_key(worker), 0, -1)]


def streaming(redis: Redis, worker: str) -> list[str]:
    """Jobs the worker holds that have text in their stream already (mid-generation)."""
    return [j for j in held(redis, worker) if any(ev.kind == "text" for ev in stream_events(redis, j))]


def wait_streaming(redis: Redis, worker: str, at_least: int, timeout: float = 120) -> list[str]:
    return list(wait_for(lambda: (s := streaming(redis, worker)) and len(s) >= at_least and s, timeout,
                         f"{worker} to be generating {at_least} jobs"))


def start_guarded_redis(dir: Path, extra: list[str], url: Callable[[int], str]) -> RedisServer:
    """A redis-server that wants credentials or TLS (RedisServer.start pings without them):
    `url(port)` is what the readiness check connects with."""
    port = free_port()
    dir.mkdir(parents=True, exist_ok=True)
    args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(dir),
            "--save", "", "--appendonly", "no", *extra]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(port, dir, process, extra)

    def pings() -> bool:
        try:
            return bool(Redis.from_url(url(port), socket_connect_timeout=0.5).ping())
        except Exception:
            return False

    try:
        wait_for(pings, 10, "redis-server to start")
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


class BackgroundResults:
    """job.result() for each job on a thread, while the test breaks things: the producer side
    must ride out what happens meanwhile."""

    def __init__(self, jobs: list[FleetJob], timeout: float) -> None:
        self.jobs = jobs
        self.timeout = timeout
        self.results: dict[str, dict[str, Any]] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            for job in self.jobs:
                self.results[job.id] = job.result(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException as e:
            self.error = e

    def join(self) -> dict[str, dict[str, Any]]:
        self._thread.join(self.timeout + 5)
        if self.error is not None:
            raise self.error
        assert len(self.results) == len(self.jobs), f"only {len(self.results)}/{len(self.jobs)} results"
        return self.results


class Workers:
    """`start(name, **settings)` real `fleet worker` processes; all killed at the end."""

    def __init__(self, redis_url: str, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.started: list[WorkerProcess] = []

    def start(self, name: str, **settings: Any) -> WorkerProcess:
        w = start_worker(self.redis_url, name, self.log_dir, **settings)
        self.started.append(w)
        return w

    def logs(self) -> str:
        return "\n".join(f"--- {w.name}\n{w.output()[-4000:]}" for w in self.started)


@contextmanager
def fleet_workers(redis_url: str, log_dir: Path) -> Iterator[Workers]:
    workers = Workers(redis_url, log_dir)
    try:
        yield workers
    finally:
        for w in workers.started:
            if w.alive():
                w.stop(signal.SIGKILL)


def live_free_slots(redis: Redis, pool: str) -> dict[str, int]:
    """Each worker's free slots as its capacity entry says, for the entries fresh enough that a
    claim counts them (CAPACITY_LIVE_MS by Redis's clock): what balance and placement see now."""
    sec, usec = redis.time()
    now_ms = sec * 1000 + usec // 1000
    live: dict[str, int] = {}
    for name, entry in redis.hgetall(capacity_key(pool)).items():
        free, _, at = text(entry).split("|")[:3]
        if now_ms - int(at) <= CAPACITY_LIVE_MS:
            live[text(name)] = int(free)
    return live


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
