"""A FleetWorker on the fake engine in this process, for tests and scripts that drive the loop
turn by turn (`run_once`) or in burst mode (`run_until_idle`): no model, no subprocess."""

from __future__ import annotations

from typing import Any

from redis import Redis

from backends.contract.keys import worker_key
from backends.fake import FakeBackend, FakeSettings
from worker.assembly import job_hooks
from worker.serving.loop import FleetWorker
from worker.settings import FleetSettings


def worker_client(url: str) -> Redis:
    """A client made the way `fleet worker` makes its own (dispatcher/cli.py), redis-py's default
    retries included."""
    return Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10, socket_keepalive=True,
                          health_check_interval=30)


def fake_worker(url: str, name: str, *, slots: int = 4, fail_after: int | None = None,
                alive: Redis | None = None, **settings: Any) -> FleetWorker:
    """A FleetWorker on the fake engine, in this process. `alive`: mark it live in Redis (its
    status key), as its heartbeat would. `settings`: FleetSettings fields (`backend` entries go
    in `backend={...}`, e.g. step_delay)."""
    backend = {"type": "fake", "slots": slots, **settings.pop("backend", {})}
    s = FleetSettings(redis_url=url, name=name, backend=backend, **settings)
    assert isinstance(s.backend, FakeSettings)  # the type set above, unless `backend` named another
    fw = FleetWorker(s, FakeBackend(s.backend, fail_after=fail_after), worker_client(url), name,
                     hooks=job_hooks(s))
    if alive is not None:
        alive.set(worker_key(name), "{}", px=600_000)
    return fw
