"""RQ bookkeeping for fleet jobs: read and check a claimed job, mark it started, store its end.

Only JSON jobs that name the one allow-listed function run. Anything else (pickle, another
function, callbacks, a bad request) is failed with a readable reason and never executed.
RQ's registries stay truthful: started (wip) while in flight, then finished / failed / canceled,
results in RQ's result stream, so `rq info`, rq-dashboard and `job.latest_result()` all work.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from redis import Redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from backends.base import GenerateRequest
from dispatcher.keys import ATTEMPT_FIELD, JOB_FUNCTION, job_key


class BadJob(Exception):
    """The job can never run: the message says why, in words a producer understands."""


@dataclass
class ClaimedJob:
    id: str
    queue: str
    attempt: int
    job: Job | None = None  # None when the RQ hash itself is unreadable
    request: GenerateRequest | None = None
    execution: Execution | None = None
    enqueued_at: float | None = None
    claimed_at: float = field(default_factory=time.time)
    deadline: float = 0.0
    first_token_at: float | None = None
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    timed_out: bool = False


def load(redis: Redis, job_id: str, queue: str, job_timeout: int) -> ClaimedJob:
    """Fetch and check a claimed job. Raises BadJob (with .claimed set) for anything refused."""
    raw_attempt = redis.hget(job_key(job_id), ATTEMPT_FIELD)
    claimed = ClaimedJob(job_id, queue, attempt=int(raw_attempt or 0) + 1)
    try:
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except Exception as e:  # missing or unreadable hash: still fail it visibly
        raise _bad(claimed, f"job {job_id} cannot be read: {_short(e)}") from None
    claimed.job = job
    claimed.enqueued_at = job.enqueued_at.timestamp() if job.enqueued_at else None
    claimed.deadline = claimed.claimed_at + (job.timeout or job_timeout)
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except Exception as e:
        raise _bad(claimed, f"refused: payload is not a JSON job ({_short(e)})") from None
    if func_name != JOB_FUNCTION:
        raise _bad(claimed, f"refused: job names function {func_name!r}; fleet workers run only {JOB_FUNCTION}")
    if any(getattr(job, f"_{kind}_callback_name", None) for kind in ("success", "failure", "stopped")):
        raise _bad(claimed, "refused: fleet jobs may not carry callbacks")
    payload = _request_payload(args, kwargs)
    if payload is None:
        raise _bad(claimed, f"refused: {JOB_FUNCTION} takes one argument, the request object")
    try:
        claimed.request = GenerateRequest.model_validate(payload)
    except ValidationError as e:
        raise _bad(claimed, "invalid request: " + describe_validation_error(e)) from None
    queue_ttl = (job.meta or {}).get("queue_ttl")
    if isinstance(queue_ttl, int | float) and claimed.enqueued_at is not None:
        waited = claimed.claimed_at - claimed.enqueued_at
        if waited > queue_ttl:
            raise _bad(claimed, f"expired: waited {waited:.1f}s in the queue, queue_ttl is {queue_ttl}s")
    return claimed


def _request_payload(args: Any, kwargs: Any) -> Any:
    if isinstance(args, list | tuple) and len(args) == 1 and not kwargs:
        return args[0]
    if not args and isinstance(kwargs, dict) and set(kwargs) == {"request"}:
        return kwargs["request"]
    return None


def describe_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _bad(claimed: ClaimedJob, reason: str) -> BadJob:
    err = BadJob(reason)
    err.claimed = claimed  # type: ignore[attr-defined]
    return err


def mark_started(claimed: ClaimedJob, worker_name: str, ttl: int, pipe: Any) -> None:
    """Started status + an RQ execution in the queue's wip registry (what `rq info` shows)."""
    assert claimed.job is not None
    claimed.job.prepare_for_execution(worker_name, pipe)
    claimed.execution = Execution.create(claimed.job, ttl=ttl, pipeline=pipe, worker_name=worker_name)


def store_success(claimed: ClaimedJob, result: dict[str, Any], worker_name: str, ttl: int, pipe: Any) -> None:
    job = claimed.job
    assert job is not None
    job.ended_at = now()
    job._result = result
    if result.get("finish_reason") == "cancelled":
        job.set_status(JobStatus.CANCELED, pipeline=pipe)
        CanceledJobRegistry(job.origin, connection=job.connection, serializer=JSONSerializer).add(job, ttl, pipe)
        Result.create(job, Result.Type.SUCCESSFUL, ttl=ttl, return_value=result, pipeline=pipe,
                      worker_name=worker_name)
    else:
        job._handle_success(ttl, pipe, worker_name=worker_name, **_execution_args(claimed))
    _end_execution(claimed, pipe)


def store_failure(claimed: ClaimedJob, reason: str, worker_name: str, ttl: int, pipe: Any) -> None:
    job = claimed.job
    if job is None:  # unreadable hash: record what we can without RQ's Job object
        pipe.hset(job_key(claimed.id), mapping={
            "status": JobStatus.FAILED.value,
            "exc_info": zlib.compress(reason.encode()),
            "ended_at": utcformat(now()),
        })
        pipe.expire(job_key(claimed.id), ttl)
        pipe.zadd(f"rq:failed:{claimed.queue}", {claimed.id: time.time() + ttl})
        return
    job.ended_at = now()
    job.set_status(JobStatus.FAILED, pipeline=pipe)
    pipe.hset(job.key, "ended_at", utcformat(job.ended_at))
    job.failure_ttl = ttl
    job._handle_failure(reason, pipe, worker_name=worker_name, **_execution_args(claimed))
    _end_execution(claimed, pipe)


def _execution_args(claimed: ClaimedJob) -> dict[str, Any]:
    if claimed.execution is None:
        return {}
    return {"execution_id": claimed.execution.id, "execution_started_at": claimed.execution.created_at,
            "execution_ended_at": now()}


def _end_execution(claimed: ClaimedJob, pipe: Any) -> None:
    if claimed.execution is not None and claimed.job is not None:
        claimed.execution.delete(claimed.job, pipe)


def failed_registry(redis: Redis, queue: str) -> FailedJobRegistry:
    return FailedJobRegistry(queue, connection=redis, serializer=JSONSerializer)


def error_payload(reason: str, claimed: ClaimedJob, worker_name: str, backend: str) -> dict[str, Any]:
    return {"job_id": claimed.id, "error": reason, "worker": worker_name, "backend": backend,
            "attempt": claimed.attempt}


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
