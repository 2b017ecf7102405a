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
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from pydantic import ValidationError
from redis import Redis
from redis.client import Pipeline
from redis.typing import EncodableT
from rq import Queue
from rq.serializers import JSONSerializer

from backends.contract.connect import MIN_REDIS_VERSION, redis_from_url
from backends.contract.keys import (
    ATTEMPT_FIELD,
    ENQUEUED_MS_META,
    FINAL_FIELD,
    JOB_FUNCTION,
    cancel_key,
    canceled_registry_key,
    job_key,
    queue_key,
    queue_name,
    stream_key,
)
from backends.contract.lua import lua_script
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
from dispatcher.stream import JobFailed, JobRestarted, TextDeltas

T = TypeVar("T")
ENDED_STATUSES = ("finished", "failed", "canceled")  # RQ statuses of a job that has its final entry
# timeouts for producer clients (sync and asyncio); no redis-py retries of their own
CLIENT_OPTIONS: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 30,
                                  "health_check_interval": 30}


class JobTimeout(Exception):
    pass


class ProducerBase:
    """What the sync `Fleet` and `AsyncFleet` (dispatcher.aio) share: settings, and a request
    turned into one RQ enqueue (validated, its id fixed before the first try)."""

    def __init__(self, redis_url: str | None = None, *, pool: str = "llm", result_ttl: int = 3600,
                 job_timeout: int = 600, queue_ttl: int | None = None, retry_for: float = 30.0,
                 durability: Durability = "primary", replica_timeout: float = 1.0) -> None:
        self.redis_url = redis_url or "redis://127.0.0.1:6379/0"
        self.pool = pool
        self.result_ttl = result_ttl
        self.job_timeout = job_timeout
        self.queue_ttl = queue_ttl
        self.retry_for = retry_for
        if durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY_MODES)}, not {durability!r}")
        self.durability = durability  # dispatcher/durability.py: what each mode promises and costs
        self.replica_timeout = replica_timeout

    @classmethod
    def from_settings(cls, config: str | None = None) -> Self:
        """A producer on the shared config (worker-config.json + FLEET_* env); worker keys are ignored."""
        s = load(ProducerSettings, config)
        return cls(s.redis_url, pool=s.pool, result_ttl=s.result_ttl, job_timeout=s.job_timeout,
                   queue_ttl=s.queue_ttl, durability=s.durability)

    def _prepare(self, prompt: str | None, priority: str, queue_ttl: int | None, job_timeout: int | None,
                 fields: dict[str, Any]) -> PreparedJob:
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
        if prompt is not None:
            fields["prompt"] = prompt
        request = validate_request(fields)
        ttl = queue_ttl or self.queue_ttl
        return PreparedJob(
            job_id=uuid.uuid4().hex,  # fixed before the first try: a retry never enqueues twice
            priority=priority,
            payload=request.model_dump(exclude_none=True, exclude_defaults=True),
            options={"job_timeout": job_timeout or self.job_timeout, "result_ttl": self.result_ttl,
                     "failure_ttl": self.result_ttl, "meta": {"queue_ttl": ttl} if ttl else {}},
        )


@dataclass
class PreparedJob:
    job_id: str
    priority: str
    payload: dict[str, Any]
    options: dict[str, Any]  # RQ's enqueue options

    def enqueue(self, queue: Queue, pipeline: Pipeline | None = None) -> None:
        """RQ's enqueue (into `pipeline` when given: its commands run at its execute)."""
        queue.enqueue(JOB_FUNCTION, self.payload, job_id=self.job_id, pipeline=pipeline, **self.options)


def rq_queues(pool: str, connection: Redis) -> dict[str, Queue]:
    """The pool's RQ queues by priority (JSON serializer: fleet jobs are never pickled). RQ asks
    the server's version with INFO (@dangerous: refused to the documented ACL user) only to pick
    LPOS; the fleet needs Redis >= 7.0 anyway (workers check it at start), so it is told that."""
    queues: dict[str, Queue] = {
        p: Queue(queue_name(pool, p), connection=connection, serializer=JSONSerializer) for p in PRIORITIES}
    for q in queues.values():
        q.redis_server_version = MIN_REDIS_VERSION
    return queues


class Fleet(ProducerBase):
    """Producer handle on one pool. Every call rides out a Redis outage: it retries on a backoff
    for up to `retry_for` seconds (stream/result: until their own timeout) before raising."""

    def __init__(self, redis_url: str | None = None, *, pool: str = "llm", redis: Redis | None = None,
                 result_ttl: int = 3600, job_timeout: int = 600, queue_ttl: int | None = None,
                 retry_for: float = 30.0, durability: Durability = "primary",
                 replica_timeout: float = 1.0) -> None:
        super().__init__(redis_url, pool=pool, result_ttl=result_ttl, job_timeout=job_timeout,
                         queue_ttl=queue_ttl, retry_for=retry_for, durability=durability,
                         replica_timeout=replica_timeout)
        if redis is None:
            # this class decides how long to wait through an outage (reconnect.py)
            redis = redis_from_url(self.redis_url, **CLIENT_OPTIONS)
        self.redis = redis
        self._queues = rq_queues(pool, redis)
        self._cancel_queued = redis.register_script(CANCEL_QUEUED)

    def submit(self, prompt: str | None = None, *, priority: str = "default", queue_ttl: int | None = None,
               job_timeout: int | None = None, **fields: Any) -> FleetJob:
        """Validate and enqueue one generation job. Raises ValueError naming any bad field.

        `queue_ttl`: seconds the job may wait in the queue before its first run; a job claimed
        later fails with "expired". `job_timeout`: wall seconds one run may take."""
        job = self._prepare(prompt, priority, queue_ttl, job_timeout, fields)
        tries = 0

        def enqueue() -> None:
            nonlocal tries
            tries += 1
            if tries > 1 and self.redis.exists(job_key(job.job_id)):
                return  # an earlier try landed; only its reply was lost (enqueue is one MULTI)
            options = job.options
            if options["meta"].get("queue_ttl"):  # measured on Redis's clock (issue 10, defect 9)
                seconds, micros = self.redis.time()
                options["meta"][ENQUEUED_MS_META] = seconds * 1000 + micros // 1000
            job.enqueue(self._queues[job.priority])

        if self.durability == "replicated":
            name = queue_name(self.pool, job.priority)
            enqueue_replicated(
                self.redis, lambda conn: job.enqueue(Queue(name, connection=conn, serializer=JSONSerializer)),
                job.job_id, self.pool, self.replica_timeout, self.retry_for)
            return FleetJob(self, job.job_id)
        self._retry(enqueue)
        with contextlib.suppress(*OUTAGE_ERRORS):
            push_wake(self.redis, self.pool)
        return FleetJob(self, job.job_id)

    def job(self, job_id: str) -> FleetJob:
        return FleetJob(self, job_id)

    def _retry(self, call: Callable[[], T]) -> T:
        return retry_outage(call, time.monotonic() + self.retry_for)


# Cancels a job that is still queued, in one step (KEYS, ARGV and reply: the script's header).
CANCEL_QUEUED = lua_script("dispatcher", "cancel_queued.lua")


def cancel_queued_call(job_id: str, queue: str, attempts: int,
                       result_ttl: int) -> tuple[list[str], list[EncodableT]]:
    """KEYS and ARGV of CANCEL_QUEUED for a job on `queue` that ran `attempts` times before."""
    result = cancelled_in_queue(job_id, attempts + 1).model_dump()
    keys = [queue_key(queue), job_key(job_id), stream_key(job_id), canceled_registry_key(queue)]
    args: list[EncodableT] = [job_id, json.dumps(result), result_ttl, time.time(), ATTEMPT_FIELD, FINAL_FIELD]
    return keys, args


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

    def __enter__(self) -> FleetJob:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """`with fleet.submit(...) as job:` cancels the job when the block is left by an exception
        (Ctrl-C included) before the job ended; JobRestarted and JobFailed do not cancel."""
        if exc_type is not None and not issubclass(exc_type, JobRestarted | JobFailed):
            self.cancel_quietly()

    def cancel_quietly(self) -> None:
        """Cancel on the way out of an interrupted read: one try, never raising (Redis may be gone)."""
        with contextlib.suppress(Exception):
            self._cancel()

    def stream(self, timeout: float | None = None, *, detach: bool = False) -> Generator[str, None, None]:
        """Text deltas as they are generated; joined, they are the final result's text.

        A job whose worker dies (or whose engine fails) mid-generation runs again as a new
        attempt, and the dead attempt's text is void. The stream then holds the new attempt's
        text back until it passes what was already yielded:
        - if the new attempt reproduces that text (greedy or seeded sampling on the same engine
          usually does), the deltas just go on: the consumer sees nothing of the restart;
        - if it diverges, JobRestarted is raised (`.delivered` is the void text). Discard what
          was shown and call stream() again: a new call starts with the live attempt's first
          token and never replays a dead attempt.
        Raises JobFailed if the job fails; returns at the end of the job (or after `timeout`).

        Interrupted (Ctrl-C, or the generator closed before the job ended, e.g. by leaving a
        `with`/`finally` around the loop), it cancels the job, unless `detach=True`: nobody
        would read what the worker goes on generating (issue 10, defect 12)."""
        try:
            yield from self._stream(timeout)
        except (GeneratorExit, KeyboardInterrupt):
            if not detach:
                self.cancel_quietly()
            raise

    def _stream(self, timeout: float | None) -> Iterator[str]:
        deltas = TextDeltas(self.id)
        for ev in self.events(timeout):
            if delta := deltas.feed(ev):
                yield delta
            if deltas.ended:
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
            keys, args = cancel_queued_call(self.id, queue, as_int(attempts), self.fleet.result_ttl)
            if self.fleet._cancel_queued(keys=keys, args=args):
                return "cancelled"
        status = self.status()
        if status in ENDED_STATUSES:
            return status
        r.set(cancel_key(self.id), 1, ex=self.fleet.job_timeout + 60)
        return "cancelling"


