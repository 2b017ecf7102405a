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

import time
from collections.abc import Iterator
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from backends.base import PRIORITIES, GenerateRequest
from dispatcher import stream
from dispatcher.keys import JOB_FUNCTION, cancel_key, queue_key, queue_name, stream_key, wake_key
from dispatcher.stream import StreamEvent


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
    def __init__(self, redis_url: str | None = None, *, pool: str = "llm", redis: Redis | None = None,
                 result_ttl: int = 3600, job_timeout: int = 600) -> None:
        if redis is None:
            redis = Redis.from_url(redis_url or "redis://127.0.0.1:6379/0")
        self.redis = redis
        self.pool = pool
        self.result_ttl = result_ttl
        self.job_timeout = job_timeout
        self._queues = {p: Queue(queue_name(pool, p), connection=redis, serializer=JSONSerializer)
                        for p in PRIORITIES}

    @classmethod
    def from_settings(cls, config: str | None = None) -> Fleet:
        from worker.settings import load_settings

        s = load_settings(config)
        return cls(s.redis_url, pool=s.pool, result_ttl=s.result_ttl, job_timeout=s.job_timeout)

    def submit(self, prompt: str | None = None, *, priority: str = "default", queue_ttl: int | None = None,
               job_timeout: int | None = None, **fields: Any) -> FleetJob:
        """Validate and enqueue one generation job. Raises ValueError naming any bad field."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
        if prompt is not None:
            fields["prompt"] = prompt
        request = validate_request(fields)
        payload = request.model_dump(exclude_none=True, exclude_defaults=True)
        meta = {"queue_ttl": queue_ttl} if queue_ttl else {}
        rq_job = self._queues[priority].enqueue(
            JOB_FUNCTION, payload, job_timeout=job_timeout or self.job_timeout,
            result_ttl=self.result_ttl, failure_ttl=self.result_ttl, meta=meta,
        )
        with self.redis.pipeline(transaction=False) as pipe:  # wake one idle worker now
            pipe.lpush(wake_key(self.pool), 1)
            pipe.ltrim(wake_key(self.pool), 0, 63)
            pipe.execute()
        return FleetJob(self, rq_job.id)

    def job(self, job_id: str) -> FleetJob:
        return FleetJob(self, job_id)


def validate_request(fields: dict[str, Any]) -> GenerateRequest:
    from pydantic import ValidationError

    try:
        return GenerateRequest.model_validate(fields)
    except ValidationError as e:
        from worker.rqjobs import describe_validation_error

        raise ValueError("invalid request: " + describe_validation_error(e)) from None


class FleetJob:
    def __init__(self, fleet: Fleet, job_id: str) -> None:
        self.fleet = fleet
        self.id = job_id

    def __repr__(self) -> str:
        return f"FleetJob({self.id!r})"

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Every stream entry from the first, then live ones, until the job ends."""
        deadline = time.monotonic() + timeout if timeout else None
        yield from stream.read_events(self.fleet.redis, self.id, deadline=deadline)

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Text deltas as they are generated. If the worker dies and the job restarts, the text
        of the dead attempt is not repeated: deltas continue from where the new attempt passes
        the point already delivered (when it produces the same text) or raise JobRestarted."""
        delivered = ""
        attempt = 0
        current = ""
        for ev in self.events(timeout):
            if ev.attempt > attempt:
                attempt, current = ev.attempt, ""
            if ev.kind == "text":
                current += ev.text
                if len(current) > len(delivered):
                    if not current.startswith(delivered):
                        raise JobRestarted(self.id, attempt, delivered)
                    yield current[len(delivered):]
                    delivered = current
            elif ev.kind == "error":
                raise JobFailed(self.id, str((ev.data or {}).get("error")), ev.data)
            else:
                return

    def result(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """Block until the job ends; return its result or raise JobFailed / JobTimeout."""
        for ev in self.events(timeout):
            if ev.kind == "done":
                return ev.data or {}
            if ev.kind == "error":
                raise JobFailed(self.id, str((ev.data or {}).get("error")), ev.data)
        raise JobTimeout(f"job {self.id} did not finish within {timeout}s (status: {self.status()})")

    def status(self) -> str:
        raw = self.fleet.redis.hget(f"rq:job:{self.id}", "status")
        return raw.decode() if raw else "unknown"

    def cancel(self) -> str:
        """Cancel: a queued job is removed at once; a running one stops at its next step.
        Returns 'cancelled' (was queued), 'cancelling' (running) or the final status."""
        r = self.fleet.redis
        origin = r.hget(f"rq:job:{self.id}", "origin")
        if origin is not None and r.lrem(queue_key(origin.decode()), 0, self.id):
            rq_job = Job.fetch(self.id, connection=r, serializer=JSONSerializer)
            with r.pipeline() as pipe:
                rq_job.set_status(JobStatus.CANCELED, pipeline=pipe)
                result = {"job_id": self.id, "text": "", "finish_reason": "cancelled",
                          "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                          "worker": None, "backend": None, "attempt": 0,
                          "timings": {"queue_ms": None, "ttft_ms": None, "total_ms": None,
                                      "tokens_per_s": None}}
                pipe.xadd(stream_key(self.id), stream.encode_done(0, result))
                pipe.expire(stream_key(self.id), self.fleet.result_ttl)
                pipe.execute()
            return "cancelled"
        if self.status() in ("finished", "failed", "canceled"):
            return self.status()
        r.set(cancel_key(self.id), 1, ex=self.fleet.job_timeout + 60)
        return "cancelling"


class JobRestarted(Exception):
    """A worker died mid-job and the new attempt's text diverges from what was already streamed."""

    def __init__(self, job_id: str, attempt: int, delivered: str) -> None:
        super().__init__(f"job {job_id} restarted (attempt {attempt}); call stream() again for the new text")
        self.attempt = attempt
        self.delivered = delivered
