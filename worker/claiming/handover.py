"""How a job passes between attempts and between tenants, as plain decisions the loop carries out:

- `resume_text`: a new attempt of a job whose last attempt wrote text continues that text on an
  engine that can (docs/reliability.md, "Resumed streams"); this reads what that attempt wrote;
- `over_buffer`: through a Redis outage, which jobs go back to their queue once Redis is back
  because the text deltas buffered for Redis passed the bound (the jobs holding most);
- `give_way`: on a full worker, which running jobs of tenants above their share of the slots go
  back to their queue so a tenant waiting below its share starts (docs/tenants.md). They are
  handed back as a drain is (not a failure) and resume later from the text they delivered.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from redis import Redis

from backends.base import Resumable
from backends.contract import stream
from backends.contract.keys import job_key, pool_queue_of, stream_key
from backends.contract.replies import as_str
from backends.contract.schema import GenerateRequest
from worker.job import ClaimedJob, tenant_of

log = logging.getLogger("fleet.worker")


def resume_text(redis: Redis, job: ClaimedJob) -> str:
    """The text the job's latest earlier attempt wrote ("" for a first attempt or none)."""
    if job.attempt <= 1:
        return ""
    entries: list[Any] = redis.xrange(stream_key(job.id)) or []
    return stream.delivered_text((fields for _id, fields in entries), job.attempt)


def resume(backend: Resumable, job: ClaimedJob, request: GenerateRequest, text: str) -> bool:
    """Admit a new attempt to continue its last attempt's text (`resume_text`); the text is
    replayed as this attempt's first delta, so a reader's stream goes on where it was. False:
    admit it anew."""
    if not text or not backend.resume(job.id, request, text):
        return False
    job.text.append(text)
    job.unsent.append(text)
    log.info("job %s resumed after %d characters (attempt %d)", job.id, len(text), job.attempt)
    return True


def give_way(running: Iterable[ClaimedJob], want: dict[str, int], over: dict[str, int]) -> list[ClaimedJob]:
    """The jobs to hand back: of each tenant above its share by `over[t]`, its newest (least text
    to prefill again), no more in all than the waiting tenants may take (`want`)."""
    budget = sum(want.values())
    out: list[ClaimedJob] = []
    jobs = [j for j in running if j.ending is None]
    for tenant, extra in over.items():
        mine = sorted((j for j in jobs if tenant_of(j) == tenant), key=lambda j: j.claimed_at, reverse=True)
        take = mine[:max(0, min(extra, budget - len(out)))]
        out += take
    return out


def never_started(redis: Redis, raw_id: bytes, queues: list[str]) -> tuple[bytes, str, int]:
    """A job in this worker's in-flight list whose claim reply never arrived, as the loop starts
    it: its id, its pool queue (from its origin, a tenant's queue too), the Redis time now."""
    origin = as_str(redis.hget(job_key("").encode() + raw_id, "origin")) or ""
    seconds, micros = redis.time()
    return raw_id, pool_queue_of(origin, queues), seconds * 1000 + micros // 1000


def over_buffer(running: Iterable[ClaimedJob], limit: int) -> list[ClaimedJob]:
    """The jobs holding most unwritten deltas, until the rest hold at most `limit`."""
    jobs = sorted(running, key=lambda j: len(j.unsent), reverse=True)
    buffered = sum(len(j.unsent) for j in jobs)
    out: list[ClaimedJob] = []
    for job in jobs:
        if buffered <= limit:
            break
        buffered -= len(job.unsent)
        out.append(job)
    return out
