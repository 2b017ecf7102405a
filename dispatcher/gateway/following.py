"""Following a request's jobs to their ends: each job's stream read into JobUpdates (text deltas,
then the result or error), and all of a request's jobs merged as they come, cancelled
(core.cancel_all) when the request's time is up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from dispatcher.aio import AsyncFleetJob
from dispatcher.gateway.core import JobUpdate, cancel_all, public_reason
from dispatcher.stream import JobFailed, JobRestarted, TextDeltas

log = logging.getLogger(__name__)


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
        yield JobUpdate(index, error=f"job {job.id} did not finish within {timeout:g}s "
                        "(gateway.request_timeout); the request's jobs are cancelled", timed_out=True)
    except JobFailed as e:
        log.info("job %s failed: %s", job.id, e.error)
        yield JobUpdate(index, error=public_reason(e.error))
    except JobRestarted:
        yield JobUpdate(index, error=f"job {job.id} restarted after its worker died, and its new text "
                        "differs from the text already sent; retry the request")


async def follow(jobs: list[AsyncFleetJob], timeout: float) -> AsyncIterator[JobUpdate]:
    """Updates of all of a request's jobs as they come; ends when every job has ended. When the
    request's time is up, its jobs are cancelled (as when the client leaves) before the update
    saying so is yielded: nobody would read what they still generate."""
    if len(jobs) == 1:
        async for update in job_updates(0, jobs[0], timeout):
            if update.timed_out:
                await asyncio.shield(cancel_all(jobs))
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
            if update.timed_out:
                await asyncio.shield(cancel_all(jobs))
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
