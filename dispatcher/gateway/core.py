"""What both HTTP APIs share: the fleet handle, admission (auth, model -> pool, 503 without
workers, 429 when the queue is full), submitting a request's jobs and following them.

Protocol quirks (SSE, NDJSON, field names, error shapes) stay in openai_api.py / ollama_api.py;
this module speaks only in fleet terms.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from backends.contract.keys import WORKERS_SET, queue_key, queue_names, worker_key
from backends.contract.replies import as_str
from backends.contract.retry import OUTAGE_ERRORS
from backends.contract.schema import PRIORITIES
from dispatcher.aio import AsyncFleet, AsyncFleetJob
from dispatcher.gateway.settings import ServeSettings
from dispatcher.stream import JobFailed, JobRestarted, TextDeltas

log = logging.getLogger("fleet.gateway")
REFRESH_INTERVAL = 1.0  # seconds between reads of the workers' status hashes
NOT_SERVING = ("draining", "stopped")  # worker states that claim no new job


class ApiError(Exception):
    """An HTTP error; each API renders it in its own error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def unsupported(field: str, api: str) -> ApiError:
    return ApiError(400, f"'{field}' is not supported by this {api} gateway (llama-fleet)",
                    param=field, code="unsupported_field")


@dataclass
class JobUpdate:
    """Something new about job `index` of a request: text, or its end (result or error)."""

    index: int
    delta: str = ""
    result: dict[str, Any] | None = None
    error: str | None = None

    @property
    def final(self) -> bool:
        return self.result is not None or self.error is not None


class Gateway:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.fleet = AsyncFleet(settings.redis_url, pool=settings.pool, result_ttl=settings.result_ttl,
                                job_timeout=settings.job_timeout, queue_ttl=settings.queue_ttl,
                                retry_for=5.0)
        self._fleets: dict[str, AsyncFleet] = {settings.pool: self.fleet}
        self.models = settings.model_pools()
        self.live_workers: dict[str, int] = {}  # pool -> serving workers, refreshed every second
        self.redis_up = False
        self._keys = [k.get_secret_value().encode() for k in settings.gateway.api_keys]
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="fleet-gateway-refresh")

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await self.fleet.aclose()

    # -- state of the fleet ---------------------------------------------------------------------

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_INTERVAL)
            await self.refresh()

    async def refresh(self) -> None:
        """Count live, serving workers per pool from their status hashes (TTL = liveness)."""
        redis = self.fleet.redis
        try:
            names = sorted(as_str(n) or "" for n in await redis.smembers(WORKERS_SET))
            async with redis.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.hmget(worker_key(name), ["pool", "state"])
                replies = await pipe.execute()
        except OUTAGE_ERRORS as e:
            if self.redis_up:
                log.warning("Redis unreachable: %s", e)
            self.redis_up = False
            return
        counts: dict[str, int] = {}
        for pool_raw, state_raw in replies:
            if pool_raw is None:
                continue  # its hash expired: dead (the reaper collects it)
            pool, state = json.loads(pool_raw), json.loads(state_raw or '""')
            if state not in NOT_SERVING:
                counts[pool] = counts.get(pool, 0) + 1
        self.live_workers = counts
        self.redis_up = True

    def fleet_for(self, pool: str) -> AsyncFleet:
        if pool not in self._fleets:
            self._fleets[pool] = self.fleet.for_pool(pool)
        return self._fleets[pool]

    # -- admission ------------------------------------------------------------------------------

    def authorized(self, authorization: str | None) -> bool:
        """No keys configured: open. Else `Bearer <key>` with one of the keys, compared in
        constant time (every key is compared, so timing tells nothing about which matched)."""
        if not self._keys:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return False
        token = given.strip().encode()
        return any([hmac.compare_digest(token, key) for key in self._keys])

    def pool_for(self, model: object) -> str:
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required: the name of a model this gateway serves",
                           param="model", code="missing_model")
        pool = self.models.get(model)
        if pool is None:
            raise ApiError(404, f"The model '{model}' does not exist (this gateway serves: "
                           f"{', '.join(sorted(self.models))})", param="model", code="model_not_found")
        return pool

    async def submit(self, pool: str, requests: list[dict[str, Any]], priority: str) -> list[AsyncFleetJob]:
        """Admit and enqueue a request's jobs (one per choice). 503 without a live worker for the
        pool, 429 when more than `max_queue` jobs wait in it, 400 for a bad field."""
        if priority not in PRIORITIES:
            raise ApiError(400, f"X-Fleet-Priority must be one of {', '.join(PRIORITIES)}, not "
                           f"{priority!r}", param="X-Fleet-Priority", code="invalid_priority")
        if not self.live_workers.get(pool):
            await self.refresh()  # a worker may have come up since the last look
            if not self.redis_up:
                raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable")
            if not self.live_workers.get(pool):
                raise ApiError(503, f"no live worker serves pool '{pool}'", code="no_workers")
        fleet = self.fleet_for(pool)
        try:
            depth = await self.queue_depth(pool, priority)
        except OUTAGE_ERRORS:
            raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable") from None
        limit = self.settings.gateway.max_queue
        if depth + len(requests) > limit:
            raise ApiError(429, f"pool '{pool}' has {depth} jobs waiting at priority {priority} or above "
                           f"(limit {limit}); retry later",
                           code="queue_full", headers={"Retry-After": str(self.settings.gateway.retry_after)})
        jobs: list[AsyncFleetJob] = []
        try:
            for fields in requests:
                jobs.append(await fleet.submit(priority=priority, **fields))
        except ValueError as e:
            await cancel_all(jobs)
            raise ApiError(400, str(e), param=field_named(str(e)), code="invalid_request") from None
        except OUTAGE_ERRORS:
            await cancel_all(jobs)
            raise ApiError(503, "the fleet's Redis is unreachable", code="redis_unavailable") from None
        return jobs

    async def queue_depth(self, pool: str, priority: str = PRIORITIES[-1]) -> int:
        """Jobs waiting that a job at `priority` competes with: its own queue and the higher ones
        (claimed first). Lower ones (a batch's lines) never delay it, so they do not count."""
        async with self.fleet.redis.pipeline(transaction=False) as pipe:
            for name in queue_names(pool)[:PRIORITIES.index(priority) + 1]:
                pipe.llen(queue_key(name))
            return sum(int(n) for n in await pipe.execute())


def field_named(message: str) -> str | None:
    """The field a validation message names ("invalid request: temperature: ...")."""
    head = message.removeprefix("invalid request: ").split(":", 1)[0].strip()
    return head.split(".")[0] if head and " " not in head else None


async def cancel_all(jobs: list[AsyncFleetJob]) -> None:
    """Cancel jobs whose client left (queued: removed; running: stopped within a step)."""
    for job in jobs:
        try:
            await job.cancel()
        except OUTAGE_ERRORS as e:
            log.warning("could not cancel job %s: %s", job.id, e)


async def job_updates(index: int, job: AsyncFleetJob, timeout: float) -> AsyncIterator[JobUpdate]:
    """One job's text deltas, then its result (or error), as JobUpdates."""
    deltas = TextDeltas(job.id)
    try:
        async for ev in job.events(timeout):
            delta = deltas.feed(ev)
            if ev.kind == "done":
                yield JobUpdate(index, delta, result=ev.data or {})
                return
            if delta:
                yield JobUpdate(index, delta)
        yield JobUpdate(index, error=f"job {job.id} did not finish within {timeout:.0f}s")
    except JobFailed as e:
        yield JobUpdate(index, error=e.error)
    except JobRestarted:
        yield JobUpdate(index, error=f"job {job.id} restarted after its worker died, and its new text "
                        "differs from the text already sent; retry the request")


async def follow(jobs: list[AsyncFleetJob], timeout: float) -> AsyncIterator[JobUpdate]:
    """Updates of all of a request's jobs as they come; ends when every job has ended."""
    if len(jobs) == 1:
        async for update in job_updates(0, jobs[0], timeout):
            yield update
        return
    queue: asyncio.Queue[JobUpdate] = asyncio.Queue()

    async def pump(index: int, job: AsyncFleetJob) -> None:
        async for update in job_updates(index, job, timeout):
            queue.put_nowait(update)

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            update = await queue.get()
            left -= update.final
            yield update
    finally:
        for task in tasks:
            task.cancel()


async def collect(jobs: list[AsyncFleetJob], timeout: float) -> list[JobUpdate]:
    """Each job's final update, text joined into result["text"] (non-streaming requests)."""
    finals: list[JobUpdate] = [JobUpdate(i) for i in range(len(jobs))]
    async for update in follow(jobs, timeout):
        if update.final:
            finals[update.index] = update
    return finals
