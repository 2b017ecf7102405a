"""What a producer decides, written once for `Fleet` (client.py) and `AsyncFleet` (aio.py); each
carries these plans out on its own client (dispatcher/plans.py) and owns its retries.

- a request is validated, given its id (fixed before the first try) and its RQ options: `prepare`;
- enqueueing writes what RQ's own `Queue.enqueue` writes, in one MULTI: the job hash RQ's `Job`
  serialises (`Job.create(...).to_dict()`), the queue in RQ's set of queues, the id pushed on the
  queue. So `rq info`, RQ's registries and a plain `rq` worker see an ordinary RQ job. A retry
  after a lost reply first asks whether the job landed, so a job is never enqueued twice;
- `queue_ttl` is measured from the enqueue on Redis's clock (recorded in the job's meta), so a
  producer's clock skew never expires a job early;
- cancel: a queued job is taken off its queue at once (cancel_queued.lua), a running one is asked
  to stop; a job that ended keeps its ending;
- a job's result is its one final stream entry (dispatcher/stream.py reads the stream).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from redis import Redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now

from backends.contract import queue as queue_model
from backends.contract import tools
from backends.contract.affinity import FIELD as AFFINITY_FIELD
from backends.contract.affinity import job_keys
from backends.contract.embed import JobRequest, parse_request
from backends.contract.keys import (
    ATTEMPT_FIELD,
    ENQUEUED_MS_META,
    FAIR_NEWCOMER,
    FAIR_TTL,
    JOB_FUNCTION,
    RQ_QUEUES_SET,
    SIZE_FIELD,
    cancel_key,
    job_key,
    queue_key,
    wake_key,
)
from backends.contract.queue import fair
from backends.contract.replies import as_int, as_str
from backends.contract.schema import (
    PRIORITIES,
    GenerateRequest,
    JobResult,
    cancelled_in_queue,
    describe_validation_error,
)
from backends.contract.stream import StreamEvent
from dispatcher.plans import Call, Eval, Plan, Round, ask, cmd
from dispatcher.stream import JobFailed

ENDED_STATUSES = ("finished", "failed", "canceled")  # RQ statuses of a job that has its final entry
# timeouts for producer clients (sync and asyncio); no redis-py retries of their own
CLIENT_OPTIONS: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 30,
                                  "health_check_interval": 30}
WAKE_TOKENS_KEPT = 64
UNREACHABLE = "unknown: Redis unreachable"  # the status a timeout reports when Redis is away too
# RQ's Job wants a connection object even to build, serialise or decode a job, which makes no
# call; this one has nowhere to connect, so a call RQ made through it would fail loudly.
RQ_OFFLINE = Redis(unix_socket_path="/nonexistent/llama-fleet-rq-offline")


class JobTimeout(Exception):
    pass


def validate_request(fields: dict[str, Any]) -> JobRequest:
    """A generation request, or an embedding one (`kind: "embed"`); ValueError naming any bad field."""
    try:
        return parse_request(fields)
    except ValidationError as e:
        raise ValueError("invalid request: " + describe_validation_error(e)) from None


@dataclass
class PreparedJob:
    """One validated request, ready to enqueue (any number of tries) as the same RQ job."""

    job_id: str
    priority: str
    payload: dict[str, Any]  # the job function's one argument
    job_timeout: int
    result_ttl: int
    meta: dict[str, Any] = field(default_factory=dict)
    affinity: list[str] = field(default_factory=list)  # its prefixes' keys (contract/affinity.py)
    size: str = ""  # its estimated size, which the claim charges its tenant (queue/fair.py)

    def rq_job(self, queue: str, enqueued_ms: int | None = None) -> Job:
        """The RQ job as `Queue.enqueue` makes it, enqueued now (`enqueued_ms`: Redis's clock)."""
        meta = {**self.meta, ENQUEUED_MS_META: enqueued_ms} if enqueued_ms is not None else self.meta
        job = Job.create(JOB_FUNCTION, args=(self.payload,), connection=RQ_OFFLINE, id=self.job_id,
                         origin=queue, timeout=self.job_timeout, result_ttl=self.result_ttl,
                         failure_ttl=self.result_ttl, meta=dict(meta), status=JobStatus.QUEUED,
                         serializer=JSONSerializer)
        job.enqueued_at = now()
        return job

    def enqueue_calls(self, queue: str, enqueued_ms: int | None = None) -> list[Call]:
        """RQ's enqueue writes (run them in one MULTI): the queue joins RQ's set of queues, the
        job hash, the id at the queue's tail. A tenant's job waits in its tenant's queue beside
        `queue`, and the tenant joins the queue's fair share (backends/contract/queue/claim.lua)."""
        tenant = self.payload.get("tenant")
        target, fair = queue_model.enqueue_target(queue, tenant)
        job = self.rq_job(target, enqueued_ms)
        calls: list[Call] = [cmd("sadd", RQ_QUEUES_SET, queue_key(target)),
                             cmd("hset", job_key(self.job_id), mapping=self._hash(job)),
                             cmd("rpush", queue_key(target), self.job_id)]
        if fair is not None:
            calls += [cmd("zadd", fair, {tenant: FAIR_NEWCOMER}, nx=True), cmd("expire", fair, FAIR_TTL)]
        if tenant:  # the places an admission reserved are held from now on for the job's lifetime
            expires = int(time.time() * 1000) + queue_model.reservation_ms(self.meta.get("queue_ttl"),
                                                                           self.job_timeout)
            for key, member in queue_model.confirm_places(tenant, self.job_id, expires):
                calls += [cmd("zadd", key, member, xx=True), cmd("pexpireat", key, expires, gt=True)]
        return calls

    def _hash(self, job: Job) -> dict[str, Any]:
        fields = job.to_dict()
        if self.affinity:
            fields[AFFINITY_FIELD] = " ".join(self.affinity)
        if self.size:
            fields[SIZE_FIELD] = self.size
        return fields


JOB_ID = re.compile(r"[0-9a-f]{32}")


def new_job_id() -> str:
    return uuid.uuid4().hex


def prepare(prompt: str | None, priority: str, fields: dict[str, Any], *, job_timeout: int,
            result_ttl: int, queue_ttl: int | None, job_id: str | None = None) -> PreparedJob:
    """Validate a request (ValueError naming any bad field) and fix its job id (`job_id`: one
    from new_job_id(), for a caller that reserved it before)."""
    if job_id is not None and not JOB_ID.fullmatch(job_id):
        raise ValueError("job_id must be 32 lowercase hex digits (new_job_id())")
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    if prompt is not None:
        fields["prompt"] = prompt
    request = validate_request(fields)
    return PreparedJob(
        job_id=job_id or new_job_id(),  # fixed before the first try: a retry never enqueues twice
        priority=priority,
        payload=request.model_dump(exclude_none=True, exclude_defaults=True),
        job_timeout=job_timeout, result_ttl=result_ttl, meta={"queue_ttl": queue_ttl} if queue_ttl else {},
        # the keys of what the worker will run (tools rendered), as it computes what it holds
        affinity=job_keys(tools.lower(request)[0]) if isinstance(request, GenerateRequest) else [],
        size=fair.size_field(request),
    )


# -- plans every producer runs ----------------------------------------------------------------------


def enqueue_plan(job: PreparedJob, queue: str, *, retried: bool) -> Plan[None]:
    """Enqueue `job` on `queue` unless a try before this one (`retried`) already landed: the
    enqueue is one MULTI, so then only its reply was lost."""
    if retried and (yield from ask(cmd("exists", job_key(job.job_id)))):
        return
    enqueued_ms = None
    if job.meta.get("queue_ttl"):
        seconds, micros = yield from ask(cmd("time"))
        enqueued_ms = int(seconds) * 1000 + int(micros) // 1000
    yield Round(job.enqueue_calls(queue, enqueued_ms), transaction=True)


def wake_plan(pool: str) -> Plan[None]:
    """Wake one idle worker (they also poll, so a lost token costs only latency)."""
    yield Round([cmd("lpush", wake_key(pool), 1), cmd("ltrim", wake_key(pool), 0, WAKE_TOKENS_KEPT - 1)])


def status_plan(job_id: str) -> Plan[str]:
    raw = yield from ask(cmd("hget", job_key(job_id), "status"))
    return as_str(raw) or "unknown"


def cancel_plan(job_id: str, result_ttl: int, job_timeout: int) -> Plan[str]:
    """Cancel: 'cancelled' (was queued, now off its queue), 'cancelling' (running: it stops at
    its next step) or the final status of a job that already ended."""
    origin, attempts = yield from ask(cmd("hmget", job_key(job_id), ["origin", ATTEMPT_FIELD]))
    if as_str(origin) is not None:
        result = cancelled_in_queue(job_id, as_int(attempts) + 1).model_dump()
        keys, args = queue_model.cancel_queued_call(job_id, result, result_ttl, time.time())
        if (yield from ask(Eval(queue_model.CANCEL_QUEUED, keys, args))):
            return "cancelled"
    status = yield from status_plan(job_id)
    if status in ENDED_STATUSES:
        return status
    yield from ask(cmd("set", cancel_key(job_id), 1, ex=job_timeout + 60))
    return "cancelling"


# -- reading a result -------------------------------------------------------------------------------


def final_result(job_id: str, ev: StreamEvent) -> JobResult | None:
    """The job's result when `ev` is its final entry; JobFailed for an error; None before."""
    if ev.kind == "done":
        return JobResult(ev.data or {})
    if ev.kind == "error":
        raise JobFailed(job_id, str((ev.data or {}).get("error")), ev.data)
    return None


def timed_out(job_id: str, timeout: float | None, status: str) -> JobTimeout:
    return JobTimeout(f"job {job_id} did not finish within {timeout}s (status: {status})")
