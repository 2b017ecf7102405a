"""The producer API on asyncio: `AsyncFleet`, the twin of `Fleet` on redis.asyncio.

    async with AsyncFleet("redis://127.0.0.1:6379/0") as fleet:
        job = await fleet.submit(prompt="Once upon a time", max_tokens=64, priority="high")
        async for text in job.stream():
            print(text, end="")
        res = await job.result(timeout=60)
        await other_job.cancel()

Same jobs, same rules as the sync API: requests are validated before anything reaches Redis,
a job is the same RQ job (RQ's own enqueue writes, sent through redis.asyncio), `stream()` has
the same attempt/restart semantics (JobRestarted when a new attempt diverges), and every call
rides out a Redis outage until its deadline.

Streams cost no connection each: one reader task per AsyncFleet follows every open stream with
one XREAD (dispatcher/stream_hub.py), so thousands of concurrent `stream()`s share it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from redis import Redis as SyncRedis
from redis.asyncio import BlockingConnectionPool, Redis
from rq import Queue

from backends.contract.connect import (
    MIN_REDIS_VERSION,
    async_redis_from_url,
    async_server_version,
    is_sentinel_url,
)
from backends.contract.keys import ATTEMPT_FIELD, cancel_key, job_key, wake_key
from backends.contract.replies import as_int, as_str
from backends.contract.retry import OUTAGE_ERRORS, retry_outage_async
from backends.contract.schema import JobResult
from backends.contract.stream import StreamEvent
from dispatcher.client import (
    CANCEL_QUEUED,
    CLIENT_OPTIONS,
    ENDED_STATUSES,
    JobTimeout,
    PreparedJob,
    ProducerBase,
    cancel_queued_call,
    rq_queues,
)
from dispatcher.durability import WAKE_TOKENS_KEPT
from dispatcher.stream import JobFailed, TextDeltas
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
        self._cancel_queued = self.redis.register_script(CANCEL_QUEUED)
        # RQ's enqueue is sync. Its writes are recorded into a pipeline of a client that never
        # connects (a path that cannot exist, so any unexpected I/O fails loudly) and replayed here.
        self._recorder = SyncRedis(unix_socket_path="/nonexistent/llama-fleet-rq-recorder")
        self._queues: dict[str, Queue] | None = None

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
        queues = await self._retry(self._rq_queues)
        tries = 0

        async def enqueue() -> None:
            nonlocal tries
            tries += 1
            if tries > 1 and await self.redis.exists(job_key(job.job_id)):
                return  # an earlier try landed; only its reply was lost (enqueue is one MULTI)
            await self._enqueue(job, queues[job.priority])

        await self._retry(enqueue)
        with contextlib.suppress(*OUTAGE_ERRORS):  # workers also poll: an outage costs only latency
            async with self.redis.pipeline(transaction=False) as pipe:  # durability.push_wake's pushes
                pipe.lpush(wake_key(self.pool), 1)
                pipe.ltrim(wake_key(self.pool), 0, WAKE_TOKENS_KEPT - 1)
                await pipe.execute()
        return AsyncFleetJob(self, job.job_id)

    async def check_server(self) -> None:
        """RedisTooOld if the server is older than the fleet needs (a gateway calls this at start;
        the first submit checks anyway)."""
        await self._rq_queues()

    async def _rq_queues(self) -> dict[str, Queue]:
        if self._queues is None:
            # HELLO, not INFO: INFO is @dangerous, which the documented ACL user may not run.
            # RQ wants the version only to choose LPOS; an ACL that refuses HELLO too leaves the
            # minimum the fleet needs anyway.
            version = await async_server_version(self.redis, self.redis_url) or MIN_REDIS_VERSION
            queues = rq_queues(self.pool, self._recorder)
            for q in queues.values():
                q.redis_server_version = version
            self._queues = queues
        return self._queues

    async def _enqueue(self, job: PreparedJob, queue: Queue) -> None:
        recorded = self._recorder.pipeline(transaction=True)
        job.enqueue(queue, pipeline=recorded)
        async with self.redis.pipeline(transaction=True) as pipe:
            for args, options in recorded.command_stack:
                pipe.execute_command(*args, **options)
            await pipe.execute()

    def job(self, job_id: str) -> AsyncFleetJob:
        return AsyncFleetJob(self, job_id)

    async def _retry(self, call: Callable[[], Awaitable[T]]) -> T:
        return await retry_outage_async(call, time.monotonic() + self.retry_for)


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
            if ev.kind == "done":
                return JobResult(ev.data or {})
            if ev.kind == "error":
                raise JobFailed(self.id, str((ev.data or {}).get("error")), ev.data)
        try:
            status = await self.status()
        except OUTAGE_ERRORS:
            status = "unknown: Redis unreachable"
        raise JobTimeout(f"job {self.id} did not finish within {timeout}s (status: {status})")

    async def status(self) -> str:
        raw = await self.fleet._retry(lambda: self.fleet.redis.hget(job_key(self.id), "status"))
        return as_str(raw) or "unknown"

    async def cancel(self) -> str:
        """Cancel: a queued job is removed at once; a running one stops at its next step.
        Returns 'cancelled' (was queued), 'cancelling' (running) or the final status."""
        return await self.fleet._retry(self._cancel)

    async def _cancel(self) -> str:
        r = self.fleet.redis
        origin, attempts = await r.hmget(job_key(self.id), ["origin", ATTEMPT_FIELD])
        queue = as_str(origin)
        if queue is not None:
            keys, args = cancel_queued_call(self.id, queue, as_int(attempts), self.fleet.result_ttl)
            if await self.fleet._cancel_queued(keys=keys, args=args):
                return "cancelled"
        status = as_str(await r.hget(job_key(self.id), "status")) or "unknown"
        if status in ENDED_STATUSES:
            return status
        await r.set(cancel_key(self.id), 1, ex=self.fleet.job_timeout + 60)
        return "cancelling"
