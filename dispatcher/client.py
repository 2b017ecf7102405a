"""The producer API: submit jobs, stream their tokens, wait for results, cancel.

    fleet = Fleet(redis_url="redis://127.0.0.1:6379/0")
    job = fleet.submit(prompt="Once upon a time", max_tokens=64, priority="high")
    for text in job.stream(): print(text, end="")
    res = job.result(timeout=60)

Requests are validated here (pydantic) before anything reaches Redis. A job is a plain RQ job
(JSON serializer, function `dispatcher.jobs.generate`) on queue `<pool>:<priority>`, so stock RQ
tools see it and plain RQ producers can enqueue the same thing.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from importlib.resources import files
from typing import Any, TypeVar

from pydantic import ValidationError
from redis import Redis
from redis.typing import EncodableT
from rq import Queue
from rq.serializers import JSONSerializer

from backends.contract.connect import redis_from_url
from backends.contract.keys import (
    ATTEMPT_FIELD,
    JOB_FUNCTION,
    cancel_key,
    canceled_registry_key,
    job_key,
    queue_key,
    queue_name,
    stream_key,
)
from backends.contract.replies import as_int, as_str
from backends.contract.retry import OUTAGE_ERRORS, retry_outage
from backends.contract.schema import (
    PRIORITIES,
    GenerateRequest,
    JobResult,
    cancelled_in_queue,
    describe_validation_error,
)
from backends.contract.settings import ProducerSettings, load
from backends.contract.stream import StreamEvent
from dispatcher import stream
from dispatcher.durability import DURABILITY_MODES, Durability, enqueue_replicated, push_wake

T = TypeVar("T")


class JobFailed(Exception):
    """The job ended with an error; `.error` is the worker's reason."""

    def __init__(self, job_id: str, error: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"job {job_id} failed: {error}")
        self.job_id = job_id
        self.error = error
        self.details = details or {}


class JobTimeout(Exception):
    pass


class Fleet:
    """Producer handle on one pool. Every call rides out a Redis outage: it retries on a backoff
    for up to `retry_for` seconds (stream/result: until their own timeout) before raising."""

    def __init__(self, redis_url: str | None = None, *, pool: str = "llm", redis: Redis | None = None,
                 result_ttl: int = 3600, job_timeout: int = 600, queue_ttl: int | None = None,
                 retry_for: float = 30.0, durability: Durability = "primary",
                 replica_timeout: float = 1.0) -> None:
        if redis is None:
            # no redis-py retries of its own: this class decides how long to wait (reconnect.py)
            redis = redis_from_url(redis_url or "redis://127.0.0.1:6379/0", socket_connect_timeout=5,
                                   socket_timeout=30, health_check_interval=30)
        self.redis = redis
        self.pool = pool
        self.result_ttl = result_ttl
        self.job_timeout = job_timeout
        self.queue_ttl = queue_ttl
        self.retry_for = retry_for
        if durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY_MODES)}, not {durability!r}")
        self.durability = durability  # dispatcher/durability.py: what each mode promises and costs
        self.replica_timeout = replica_timeout
        self._queues = {p: Queue(queue_name(pool, p), connection=redis, serializer=JSONSerializer)
                        for p in PRIORITIES}
        self._cancel_queued = redis.register_script(_CANCEL_QUEUED_LUA)

    @classmethod
    def from_settings(cls, config: str | None = None) -> Fleet:
        """A Fleet on the shared config (worker-config.json + FLEET_* env); worker keys are ignored."""
        s = load(ProducerSettings, config)
        return cls(s.redis_url, pool=s.pool, result_ttl=s.result_ttl, job_timeout=s.job_timeout,
                   queue_ttl=s.queue_ttl, durability=s.durability)

    def submit(self, prompt: str | None = None, *, priority: str = "default", queue_ttl: int | None = None,
               job_timeout: int | None = None, **fields: Any) -> FleetJob:
        """Validate and enqueue one generation job. Raises ValueError naming any bad field.

        `queue_ttl`: seconds the job may wait in the queue before its first run; a job claimed
        later fails with "expired". `job_timeout`: wall seconds one run may take."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
        if prompt is not None:
            fields["prompt"] = prompt
        request = validate_request(fields)
        payload = request.model_dump(exclude_none=True, exclude_defaults=True)
        ttl = queue_ttl or self.queue_ttl
        meta = {"queue_ttl": ttl} if ttl else {}
        job_id = uuid.uuid4().hex  # fixed before the first try: a retry never enqueues twice
        tries = 0

        def enqueue_on(queue: Queue) -> None:
            queue.enqueue(
                JOB_FUNCTION, payload, job_id=job_id, job_timeout=job_timeout or self.job_timeout,
                result_ttl=self.result_ttl, failure_ttl=self.result_ttl, meta=meta,
            )

        def enqueue() -> None:
            nonlocal tries
            tries += 1
            if tries > 1 and self.redis.exists(job_key(job_id)):
                return  # an earlier try landed; only its reply was lost (enqueue is one MULTI)
            enqueue_on(self._queues[priority])

        if self.durability == "replicated":
            name = queue_name(self.pool, priority)
            enqueue_replicated(
                self.redis, lambda conn: enqueue_on(Queue(name, connection=conn, serializer=JSONSerializer)),
                job_id, self.pool, self.replica_timeout, self.retry_for)
            return FleetJob(self, job_id)
        self._retry(enqueue)
        with contextlib.suppress(*OUTAGE_ERRORS):
            push_wake(self.redis, self.pool)
        return FleetJob(self, job_id)

    def job(self, job_id: str) -> FleetJob:
        return FleetJob(self, job_id)

    def _retry(self, call: Callable[[], T]) -> T:
        return retry_outage(call, time.monotonic() + self.retry_for)


# Cancels a job that is still queued, in one step (see the script's header).
_CANCEL_QUEUED_LUA = files("dispatcher").joinpath("cancel_queued.lua").read_text()


def validate_request(fields: dict[str, Any]) -> GenerateRequest:
    try:
        return GenerateRequest.model_validate(fields)
    except ValidationError as e:
        raise ValueError("invalid request: " + describe_validation_error(e)) from None


class FleetJob:
    def __init__(self, fleet: Fleet, job_id: str) -> None:
        self.fleet = fleet
        self.id = job_id

    def __repr__(self) -> str:
        return f"FleetJob({self.id!r})"

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """The job's live stream entries from the first, then new ones, until the job ends.

        Entries of a void attempt are left out; when a new attempt replaces text already yielded,
        a `restart` event comes first (dispatcher/stream.py has the rules)."""
        deadline = time.monotonic() + timeout if timeout else None
        yield from stream.read_events(self.fleet.redis, self.id, deadline=deadline)

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Text deltas as they are generated; joined, they are the final result's text.

        A job whose worker dies (or whose engine fails) mid-generation runs again as a new
        attempt, and the dead attempt's text is void. The stream then holds the new attempt's
        text back until it passes what was already yielded:
        - if the new attempt reproduces that text (greedy or seeded sampling on the same engine
          usually does), the deltas just go on: the consumer sees nothing of the restart;
        - if it diverges, JobRestarted is raised (`.delivered` is the void text). Discard what
          was shown and call stream() again: a new call starts with the live attempt's first
          token and never replays a dead attempt.
        Raises JobFailed if the job fails; returns at the end of the job (or after `timeout`)."""
        delivered = ""
        current = ""
        for ev in self.events(timeout):
            if ev.kind == "restart":
                current = ""
            elif ev.kind == "text":
                current += ev.text
                if not (current.startswith(delivered) or delivered.startswith(current)):
                    raise JobRestarted(self.id, ev.attempt, delivered)
                if len(current) > len(delivered):
                    yield current[len(delivered):]
                    delivered = current
            elif ev.kind == "error":
                raise JobFailed(self.id, str((ev.data or {}).get("error")), ev.data)
            else:  # done: the final text may be shorter than the void text yielded before
                final = str((ev.data or {}).get("text", current))
                if final != delivered and final.startswith(delivered):
                    yield final[len(delivered):]
                elif final != delivered:
                    raise JobRestarted(self.id, ev.attempt, delivered)
                return

    def result(self, timeout: float | None = 60.0) -> JobResult:
        """Block until the job ends; return its one final result or raise JobFailed / JobTimeout.
        Waits through Redis outages (until `timeout`)."""
        for ev in self.events(timeout):
            if ev.kind == "done":
                return JobResult(ev.data or {})
            if ev.kind == "error":
                raise JobFailed(self.id, str((ev.data or {}).get("error")), ev.data)
        status = self._status_or_unknown()
        raise JobTimeout(f"job {self.id} did not finish within {timeout}s (status: {status})")

    def status(self) -> str:
        raw = self.fleet._retry(lambda: self.fleet.redis.hget(job_key(self.id), "status"))
        return as_str(raw) or "unknown"

    def _status_or_unknown(self) -> str:
        try:
            return self.status()
        except OUTAGE_ERRORS:
            return "unknown: Redis unreachable"

    def cancel(self) -> str:
        """Cancel: a queued job is removed at once; a running one stops at its next step.
        Returns 'cancelled' (was queued), 'cancelling' (running) or the final status."""
        return self.fleet._retry(self._cancel)

    def _cancel(self) -> str:
        r = self.fleet.redis
        origin, attempts = r.hmget(job_key(self.id), ["origin", ATTEMPT_FIELD])
        queue = as_str(origin)
        if queue is not None:
            result = cancelled_in_queue(self.id, as_int(attempts) + 1).model_dump()
            keys = [queue_key(queue), job_key(self.id), stream_key(self.id), canceled_registry_key(queue)]
            args: list[EncodableT] = [self.id, json.dumps(result), self.fleet.result_ttl, time.time(),
                                      ATTEMPT_FIELD]
            if self.fleet._cancel_queued(keys=keys, args=args):
                return "cancelled"
        status = self.status()
        if status in ("finished", "failed", "canceled"):
            return status
        r.set(cancel_key(self.id), 1, ex=self.fleet.job_timeout + 60)
        return "cancelling"


class JobRestarted(Exception):
    """The job restarted (its worker died) and the new attempt's text diverges from what
    stream() already yielded; call stream() again for the new attempt's text."""

    def __init__(self, job_id: str, attempt: int, delivered: str) -> None:
        super().__init__(f"job {job_id} restarted (attempt {attempt}); call stream() again for the new text")
        self.job_id = job_id
        self.attempt = attempt
        self.delivered = delivered
