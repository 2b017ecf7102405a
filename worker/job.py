"""A job this worker claimed: what the loop, the claim's handover, the hooks and the reaper all
hold of it (its RQ record, its request, its text so far, what Redis has not seen yet, its ending),
apart from the RQ bookkeeping that reads and writes it (worker/serving/rqjobs.py)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer

from backends.contract.embed import JobRequest
from backends.contract.queue import split_queue
from backends.contract.schema import DEFAULT_TENANT


@dataclass
class Ending:
    """The one final entry a job gets: a result (finished or cancelled) or a failure reason."""

    result: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class ClaimedJob:
    id: str
    queue: str
    attempt: int
    job: Job | None = None  # None when the RQ hash itself is unreadable
    # a generation (as the engine runs it: tools rendered, contract tools.lower) or an embedding job
    request: JobRequest | None = None
    tool_answer: bool = False  # the text is answer JSON (words, calls, thoughts), read into the result
    execution: Execution | None = None
    # Redis server time (ms) of the enqueue and the claim: queue_ttl compares these, never two
    # hosts' wall clocks (they drift apart); durations of the run itself use this host's
    # monotonic clock
    enqueued_ms: int | None = None
    claimed_ms: int | None = None
    claimed_at: float = field(default_factory=time.monotonic)
    deadline: float = 0.0  # time.monotonic()
    first_token_at: float | None = None  # time.monotonic()
    drains: int = 0  # earlier attempts handed back by a draining worker (not failures)
    stale_execution: str | None = None  # an RQ execution of an earlier start of this attempt
    origin: str = ""  # the queue its producer put it on (RQ's origin: a tenant's own queue)
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    timed_out: bool = False
    # What Redis has not seen yet (kept through a Redis outage, written in order when it is back):
    unsent: list[str] = field(default_factory=list)  # text deltas of this attempt
    sent: int = 0  # deltas of this attempt already written: the stream index of the next one
    attempt_dirty: bool = False  # the engine restarted the job: write the new attempt first
    restart_reason: str = ""  # why the engine restarted it (for the job's history)
    started_written: bool = False  # RQ knows it started (mark_started applied)
    suspect: bool = False  # its start named this worker in SUSPECT_FIELD; cleared with its first text
    ending: Ending | None = None



def tenant_of(job: ClaimedJob) -> str:
    """Whose job it is: its request's tenant (none named: the default tenant's); a job ended
    before its request was read (refused, or its start failed) is its origin's tenant's, the
    queue the gateway enqueued it on (a job holding a tenant's places always came that way)."""
    if job.request is not None:
        return job.request.tenant or DEFAULT_TENANT
    return split_queue(job.origin)[1] if job.origin else DEFAULT_TENANT


def unloaded(redis: Redis, job_id: str, queue: str, attempt: int, ending: Ending | None = None) -> ClaimedJob:
    """A job ended without being loaded (the reaper's give-up, the loop's internal error starting
    it), with its RQ record where it reads: its ending then frees its tenant's places and
    counts to its tenant. `ending`: where the caller does not set it itself."""
    claimed = ClaimedJob(job_id, queue, attempt=attempt, ending=ending)
    with contextlib.suppress(Exception):  # missing or unreadable: ended by its id alone
        claimed.job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
        claimed.origin = claimed.job.origin
    return claimed
