"""The producer API on asyncio: `AsyncFleet`, the twin of `Fleet` on redis.asyncio.

    async with AsyncFleet("redis://127.0.0.1:6379/0") as fleet:
        job = await fleet.submit(prompt="Once upon a time", max_tokens=64, priority="high")
        async for text in job.stream():
            print(text, end="")
        res = await job.result(timeout=60)
        await other_job.cancel()

Same jobs, same rules as the sync API, from the same code: dispatcher/rules.py decides what is
validated, written (the same RQ job) and read, and this class runs it on redis.asyncio
(dispatcher/plans.py). `stream()` has the same attempt/restart semantics (JobRestarted when a new
attempt diverges), and every call rides out a Redis outage until its deadline.

Streams cost no connection each: one reader task per AsyncFleet follows every open stream with
one XREAD (dispatcher/stream_hub.py), so thousands of concurrent `stream()`s share it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis

from backends.contract.connect import async_redis_from_url, async_server_version, is_sentinel_url
from backends.contract.embed import embed_fields, embeddings_of
from backends.contract.keys import queue_name
from backends.contract.retry import OUTAGE_ERRORS, retry_outage_async
from backends.contract.schema import JobResult
from backends.contract.stream import StreamEvent
from dispatcher.client import ProducerBase
from dispatcher.plans import Plan, run_async
from dispatcher.rules import (
    CLIENT_OPTIONS,
    UNREACHABLE,
    cancel_plan,
    enqueue_plan,
    final_result,
    status_plan,
    timed_out,
    wake_plan,
)
from dispatcher.stream import TextDeltas
from dispatcher.stream_hub import StreamHub

T = TypeVar("T")


class AsyncFleet(ProducerBase):
    """Producer handle on one pool, for asyncio code. Close it (`await fleet.aclose()`, or use
    `async with`) to stop its stream reader and release its connections. It opens at most
    `max_connections` connections to Redis, however many jobs it submits or follows at once."""

    def __init__(self, redis_url: str | None = None, *, pool: str = "llm", redis: Redis | None = None,
                 result_ttl: int = 3600, job_timeout: int = 600, queue_ttl: int | None = None,
                 retry_for: float = 30.0, max_connections: int = 32,
                 streams: StreamHub | None = None) -> None:
        super().__init__(redis_url, pool=pool, result_ttl=result_ttl, job_timeout=job_timeout,
                         queue_ttl=queue_ttl, retry_for=retry_for)
        if self.durability != "primary":
            raise ValueError("AsyncFleet supports durability 'primary' only (use Fleet for 'replicated')")
        self.redis = redis if redis is not None else _client(self.redis_url, max_connections)
        self.streams = streams or StreamHub(self.redis)
        self._server_checked = False

    def for_pool(self, pool: str) -> AsyncFleet:
        """A handle on another pool that shares this one's connections and stream reader (close
        only this one)."""
        return AsyncFleet(self.redis_url, pool=pool, redis=self.redis, result_ttl=self.result_ttl,
                          job_timeout=self.job_timeout, queue_ttl=self.queue_ttl, retry_for=self.retry_for,
                          streams=self.streams)

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.streams.close()
        await self.redis.aclose()

    async def submit(self, prompt: str | None = None, *, priority: str = "default",
                     queue_ttl: int | None = None, job_timeout: int | None = None,
                     **fields: Any) -> AsyncFleetJob:
        """Validate and enqueue one generation job (Fleet.submit's arguments). Raises ValueError
        naming any bad field; retries through a Redis outage for up to `retry_for` seconds."""
        job = self._prepare(prompt, priority, queue_ttl, job_timeout, fields)
        await self._retry(self.check_server)
        queue = queue_name(self.pool, job.priority)
        tries = 0

        async def enqueue() -> None:
            nonlocal tries
            tries += 1
            await run_async(self.redis, enqueue_plan(job, queue, retried=tries > 1))

        await self._retry(enqueue)
        with contextlib.suppress(*OUTAGE_ERRORS):  # workers also poll: an outage costs only latency
            await run_async(self.redis, wake_plan(self.pool))
        return AsyncFleetJob(self, job.job_id)

    async def submit_embed(self, texts: str | Sequence[str], *, priority: str = "default",
                           queue_ttl: int | None = None, job_timeout: int | None = None,
                           **fields: Any) -> AsyncFleetJob:
        """Enqueue one embedding job (Fleet.submit_embed)."""
        return await self.submit(priority=priority, queue_ttl=queue_ttl, job_timeout=job_timeout,
                                 **embed_fields(texts, **fields))

    async def embed(self, texts: str | Sequence[str], *, timeout: float | None = 60.0,
                    **options: Any) -> list[list[float]]:
        """The texts' vectors, in order (Fleet.embed)."""
        job = await self.submit_embed(texts, **options)
        return embeddings_of(await job.result(timeout))

    async def check_server(self) -> None:
        """RedisTooOld if the server is older than the fleet needs (a gateway calls this at start;
        the first submit checks anyway). HELLO, not INFO: INFO is @dangerous, which the documented
        ACL user may not run; an ACL that refuses HELLO too leaves the version unknown."""
        if not self._server_checked:
            await async_server_version(self.redis, self.redis_url)
            self._server_checked = True

    def job(self, job_id: str) -> AsyncFleetJob:
        return AsyncFleetJob(self, job_id)

    async def _retry(self, call: Callable[[], Awaitable[T]]) -> T:
        return await retry_outage_async(call, time.monotonic() + self.retry_for)

    async def _run(self, make_plan: Callable[[], Plan[T]]) -> T:
        """A fresh plan from `make_plan` on each try through an outage."""
        return await self._retry(lambda: run_async(self.redis, make_plan()))


def _client(url: str, max_connections: int) -> Redis:
    if is_sentinel_url(url):  # Sentinel's own pool, which follows failovers
        return async_redis_from_url(url, **CLIENT_OPTIONS)
    # a bounded pool: a burst of requests waits for a connection instead of opening more
    return Redis.from_pool(BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                           **CLIENT_OPTIONS))


class AsyncFleetJob:
    def __init__(self, fleet: AsyncFleet, job_id: str) -> None:
        self.fleet = fleet
        self.id = job_id

    def __repr__(self) -> str:
        return f"AsyncFleetJob({self.id!r})"

    async def events(self, timeout: float | None = None) -> AsyncIterator[StreamEvent]:
        """The job's live stream entries from the first until the job ends (FleetJob.events)."""
        deadline = time.monotonic() + timeout if timeout else None
        async for ev in self.fleet.streams.events(self.id, deadline):
            yield ev

    async def stream(self, timeout: float | None = None) -> AsyncIterator[str]:
        """Text deltas as they are generated; joined, they are the final result's text. Restarts
        behave as in FleetJob.stream: a new attempt that repeats the text goes on seamlessly, one
        that diverges raises JobRestarted. Raises JobFailed if the job fails; returns at the end
        of the job (or after `timeout`)."""
        deltas = TextDeltas(self.id)
        async for ev in self.events(timeout):
            if delta := deltas.feed(ev):
                yield delta
            if deltas.ended:
                return

    async def result(self, timeout: float | None = 60.0) -> JobResult:
        """Wait until the job ends; return its final result or raise JobFailed / JobTimeout."""
        async for ev in self.events(timeout):
            if (result := final_result(self.id, ev)) is not None:
                return result
        try:
            status = await self.status()
        except OUTAGE_ERRORS:
            status = UNREACHABLE
        raise timed_out(self.id, timeout, status)

    async def status(self) -> str:
        return await self.fleet._run(lambda: status_plan(self.id))

    async def cancel(self) -> str:
        """Cancel: a queued job is removed at once; a running one stops at its next step.
        Returns 'cancelled' (was queued), 'cancelling' (running) or the final status."""
        return await self.fleet._run(lambda: cancel_plan(self.id, self.fleet.result_ttl,
                                                         self.fleet.job_timeout))
