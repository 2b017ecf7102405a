"""How durable `submit()` is before it returns: the `durability` producer setting.

- `primary` (default): the job is in the primary's memory (and, with the shipped config, in its
  AOF within a second). Fast: one round trip. A primary that dies before a replica copied the
  job loses it, even though the producer was told it was enqueued.
- `replicated`: after enqueueing, the producer sends Redis `WAIT 1 <timeout>` on the same
  connection and returns only when at least one replica holds the job. A Sentinel failover
  promotes a replica, so an acknowledged job survives the primary's `kill -9`. Costs a replica
  round trip per submit (docs/scale-out.md has the numbers), and submit fails with
  `NotReplicated` when no replica confirms within `retry_for` (no replica at all, or it lags).

WAIT counts the writes of the connection it runs on, so the enqueue (or, when an earlier try
already landed, the wake-up push that follows every submit) and the WAIT share one connection:
a fresh connection with no writes would "confirm" at once whatever the replica holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from redis import Redis

from backends.contract.keys import job_key
from backends.contract.retry import retry_outage
from dispatcher.plans import run
from dispatcher.rules import wake_plan

Durability = Literal["primary", "replicated"]
DURABILITY_MODES: tuple[Durability, ...] = ("primary", "replicated")


class NotReplicated(Exception):
    """No replica confirmed the job in time: it may be lost if the primary fails now."""

    def __init__(self, job_id: str, waited: float) -> None:
        super().__init__(f"job {job_id}: no replica confirmed it within {waited:.1f}s "
                         "(durability 'replicated'; is a replica attached and in sync?)")
        self.job_id = job_id


def push_wake(redis: Redis, pool: str) -> None:
    """Wake one idle worker (they also poll, so a lost token costs only latency)."""
    run(redis, wake_plan(pool))


def enqueue_replicated(redis: Redis, enqueue: Callable[[Redis], None], job_id: str, pool: str,
                       wait_timeout: float, retry_for: float) -> None:
    """Enqueue (once) on the primary, then WAIT until a replica holds it. After a failover the
    new primary may lack a job the old one accepted but never copied: it is enqueued again under
    the same id, so the job exists exactly once either way."""
    started = time.monotonic()
    deadline = started + retry_for

    def once() -> bool:
        conn = Redis(connection_pool=redis.connection_pool, single_connection_client=True)
        try:
            if not conn.exists(job_key(job_id)):
                enqueue(conn)
            push_wake(conn, pool)  # a write on this connection: WAIT then covers the job too
            return int(conn.execute_command("WAIT", 1, max(1, int(wait_timeout * 1000)))) >= 1
        finally:
            conn.close()

    while not retry_outage(once, deadline):
        if time.monotonic() >= deadline:
            raise NotReplicated(job_id, time.monotonic() - started)
