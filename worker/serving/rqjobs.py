"""RQ bookkeeping for fleet jobs: read and check a claimed job, mark it started, store its end.

Only JSON jobs that name the one allow-listed function run. Anything else (pickle, another
function, callbacks, a bad request) is failed with a readable reason and never executed.
RQ's registries stay truthful: started (wip) while in flight, then finished / failed / canceled,
results in RQ's result stream, so `rq info`, rq-dashboard and `job.latest_result()` all work.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import ResponseError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from backends.contract import tools
from backends.contract.embed import JobRequest, parse_request
from backends.contract.keys import (
    ATTEMPT_FIELD,
    DRAINS_FIELD,
    ENQUEUED_MS_META,
    EXECUTION_FIELD,
    FINAL_FIELD,
    JOB_FUNCTION,
    OWNER_FIELD,
    SUSPECT_FIELD,
    execution_key,
    failed_registry_key,
    inflight_key,
    job_key,
)
from backends.contract.replies import as_int, as_str
from backends.contract.schema import GenerateRequest, describe_validation_error
from worker.job import ClaimedJob
from worker.serving import limits

log = logging.getLogger("fleet.worker")


class BadJob(Exception):
    """The job can never run: the message says why, in words a producer understands."""

    def __init__(self, claimed: ClaimedJob, reason: str) -> None:
        super().__init__(reason)
        self.claimed = claimed


class NotToRun(Exception):
    """A claimed id that must not run and gets no result of its own: the job already ended, or
    the id is a second copy of a job that is running (a duplicate push)."""


class CancelledByRQ(Exception):
    """RQ's own job.cancel() reached the job before it ran: it ends as cancelled (a final entry,
    so fleet readers do not wait for one that never comes)."""

    def __init__(self, claimed: ClaimedJob) -> None:
        super().__init__(f"job {claimed.id} was cancelled with RQ")
        self.claimed = claimed


ENDED = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED}


def load(redis: Redis, job_id: str, queue: str, job_timeout: int, queue_ttl: float | None = None, *,
         me: str = "", budget: limits.RequestBudget | None = None,
         claimed_ms: int | None = None,
         as_sent: Callable[[GenerateRequest], bool] | None = None) -> ClaimedJob:
    """Fetch and check a job this worker (`me`) claimed. Raises BadJob for anything refused,
    NotToRun for an id that must be dropped without a result, CancelledByRQ. A job this worker
    already owns (a start whose reply was lost) is resumed, not dropped. `job_timeout`/`queue_ttl`
    apply when the job sets none; `budget` bounds the request (worker/serving/limits.py); a
    request the engine takes `as_sent` (its model's own dialect) is not lowered to the generic
    tool format."""
    fields = [ATTEMPT_FIELD, OWNER_FIELD, DRAINS_FIELD, EXECUTION_FIELD, FINAL_FIELD, "origin"]
    try:
        raw_attempt, owner, drains, execution, final, origin = redis.hmget(job_key(job_id), fields)
    except ResponseError as e:  # e.g. WRONGTYPE: the key is not a hash
        unreadable = ClaimedJob(job_id, queue, attempt=1)
        raise BadJob(unreadable, f"job {job_id} cannot be read: {_short(e)}") from None
    claimed = ClaimedJob(job_id, queue, attempt=as_int(raw_attempt) + 1, drains=as_int(drains),
                         stale_execution=as_str(execution), claimed_ms=claimed_ms,
                         origin=as_str(origin) or "")
    if budget is not None:
        try:
            limits.check_payload(redis, job_id, budget)
        except limits.TooLarge as e:
            raise BadJob(claimed, str(e)) from None
    try:
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except Exception as e:  # missing or unreadable hash: still fail it visibly
        raise BadJob(claimed, f"job {job_id} cannot be read: {_short(e)}") from None
    claimed.job = job
    if me:
        _check_owner(redis, job, me, as_str(owner))
    _check_not_ended(claimed, job, final)
    if raw_attempt is not None and as_int(raw_attempt, -1) < 0:
        raise BadJob(claimed, f"refused: job field {ATTEMPT_FIELD} is not a count ({_clip(raw_attempt)})")
    claimed.enqueued_ms = _enqueued_ms(job)
    timeout = job.timeout if isinstance(job.timeout, int | float) and job.timeout > 0 else job_timeout
    claimed.deadline = claimed.claimed_at + timeout
    _check_code(claimed, job)
    request = _request(claimed, job)
    if budget is not None:  # as sent: lowering and tokenizing come after, and cost with its size
        try:
            limits.check_request(request, budget)
        except limits.TooLarge as e:
            raise BadJob(claimed, str(e)) from None
    if isinstance(request, GenerateRequest) and as_sent is not None and as_sent(request):
        claimed.request, claimed.tool_answer = request, tools.answers_in_json(request)
    elif isinstance(request, GenerateRequest):
        claimed.request, claimed.tool_answer = tools.lower(request)
    else:
        claimed.request = request
    _check_queue_ttl(claimed, job.meta, queue_ttl)
    return claimed


def _check_owner(redis: Redis, job: Job, me: str, owner: str | None) -> None:
    """The claim script made this worker the owner. An id that reached the in-flight list another
    way (pushed there by hand, or by an older worker) is taken over unless its owner holds it."""
    if owner == me:
        return
    holder = inflight_key(owner) if owner else ""
    # an owner whose in-flight key is not a list (a producer wrote the field) holds nothing
    if holder and redis.type(holder) in (b"list", "list") and redis.lpos(holder, job.id) is not None:
        raise NotToRun(f"job {job.id} is already running on {owner}")
    redis.hset(job.key, OWNER_FIELD, me)


def _check_not_ended(claimed: ClaimedJob, job: Job, final: Any) -> None:
    status = job.get_status(refresh=False)
    if status == JobStatus.CANCELED and final is None:
        raise CancelledByRQ(claimed)
    if status in ENDED:
        raise NotToRun(f"job {job.id} already {status.value}")


def _enqueued_ms(job: Job) -> int | None:
    """The producer's Redis server time of the enqueue; a plain RQ producer records only its own
    wall clock (`enqueued_at`), which is used then."""
    meta = job.meta if isinstance(job.meta, dict) else {}
    server_ms = meta.get(ENQUEUED_MS_META)
    if isinstance(server_ms, int) and not isinstance(server_ms, bool):
        return server_ms
    return int(job.enqueued_at.timestamp() * 1000) if job.enqueued_at else None


def _check_code(claimed: ClaimedJob, job: Job) -> None:
    """Only the allow-listed function, only JSON, no callbacks: nothing a producer sends runs code."""
    try:
        func_name = job.func_name
    except Exception as e:
        raise BadJob(claimed, f"refused: payload is not a JSON job ({_short(e)})") from None
    if func_name != JOB_FUNCTION:
        raise BadJob(claimed, f"refused: job names function {_clip(func_name)}; fleet workers run only "
                              f"{JOB_FUNCTION}")
    if any(getattr(job, f"_{kind}_callback_name", None) for kind in ("success", "failure", "stopped")):
        raise BadJob(claimed, "refused: fleet jobs may not carry callbacks")
    if getattr(job, "webhooks", None):
        raise BadJob(claimed, "refused: fleet jobs may not carry webhooks")


def _request(claimed: ClaimedJob, job: Job) -> JobRequest:
    payload = _request_payload(job.args, job.kwargs)
    if payload is None:
        raise BadJob(claimed, f"refused: {JOB_FUNCTION} takes one argument, the request object")
    try:
        return parse_request(payload)
    except ValidationError as e:
        raise BadJob(claimed, "invalid request: " + describe_validation_error(e)) from None


def _check_queue_ttl(claimed: ClaimedJob, meta: Any, default: float | None) -> None:
    """A job may wait `queue_ttl` seconds for its first run (a requeued job already had its turn)."""
    ttl = meta.get("queue_ttl", default) if isinstance(meta, dict) else default
    if ttl is None or claimed.attempt > 1 or claimed.enqueued_ms is None or claimed.claimed_ms is None:
        return
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise BadJob(claimed, f"refused: meta.queue_ttl must be a number of seconds, not {_clip(ttl)}")
    waited = (claimed.claimed_ms - claimed.enqueued_ms) / 1000
    if waited > ttl:
        raise BadJob(claimed, f"expired: waited {waited:.1f}s in the queue, queue_ttl is {ttl}s")


def _request_payload(args: Any, kwargs: Any) -> Any:
    if isinstance(args, list | tuple) and len(args) == 1 and not kwargs:
        return args[0]
    if not args and isinstance(kwargs, dict) and set(kwargs) == {"request"}:
        return kwargs["request"]
    return None


def _short(e: BaseException) -> str:
    """Why a payload cannot be read, in words a producer can act on: the root cause (RQ wraps
    its decoder's error), never a Python type name (the worker's log keeps those)."""
    log.info("unreadable job: %s: %s", type(e).__name__, e)
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    if isinstance(e, RecursionError):
        return "it nests too deeply"
    if isinstance(e, UnicodeDecodeError):
        return f"it is not valid UTF-8 (at byte {e.start})"
    if isinstance(e, json.JSONDecodeError):
        return f"it is not valid JSON ({e.msg} at {e.pos})"
    if isinstance(e, zlib.error):
        return "it is neither JSON nor zlib-compressed JSON"
    if isinstance(e, ResponseError) and "WRONGTYPE" in str(e):
        return "its key is not a hash"
    return (str(e) or "unreadable")[:300]


def _clip(value: Any) -> str:
    return repr(value)[:120]


def mark_started(claimed: ClaimedJob, worker_name: str, ttl: int, pipe: Any) -> None:
    """Started status + an RQ execution in the queue's wip registry (what `rq info` shows). A
    start again (its first reply was lost) replaces the first start's execution (RQ's wip registry
    keeps one per attempt)."""
    job = claimed.job
    assert job is not None
    earlier = claimed.execution.composite_key if claimed.execution is not None else None
    for stale in filter(None, {claimed.stale_execution, earlier}):  # a try whose reply was lost
        pipe.zrem(job.started_job_registry.key, stale)
        pipe.delete(execution_key(stale))
    job.prepare_for_execution(worker_name, pipe)
    claimed.execution = Execution.create(job, ttl=ttl, pipeline=pipe, worker_name=worker_name)
    pipe.hset(job.key, EXECUTION_FIELD, claimed.execution.composite_key)
    mark_suspect(claimed, worker_name, pipe)


def mark_suspect(claimed: ClaimedJob, worker_name: str, pipe: Any) -> None:
    """A job with structured output is suspect from its start until its first text is written:
    its grammar is compiled and first applied in between, the steps a hostile schema could crash
    the process with. The reaper fails, never re-runs, a job whose worker died while it was
    suspect (docs/reliability.md, "Dead workers"); other jobs are requeued as always."""
    request = claimed.request
    claimed.suspect = isinstance(request, GenerateRequest) and request.format is not None
    if claimed.suspect:
        pipe.hset(job_key(claimed.id), SUSPECT_FIELD, worker_name)
    else:
        pipe.hdel(job_key(claimed.id), SUSPECT_FIELD)


# Clears SUSPECT_FIELD only while it names this worker (a worker the reaper took the job from
# must not clear the mark of the worker running it now). KEYS: job hash; ARGV: field, worker.
CLEAR_SUSPECT = """
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


def store_success(claimed: ClaimedJob, result: dict[str, Any], worker_name: str, ttl: int, pipe: Any) -> None:
    job = claimed.job
    assert job is not None
    job.ended_at = now()
    job._result = result
    if result.get("finish_reason") == "cancelled":
        job.set_status(JobStatus.CANCELED, pipeline=pipe)
        registry = CanceledJobRegistry(job.origin, connection=job.connection, serializer=JSONSerializer)
        registry.add(job, ttl, pipe)
        Result.create(job, Result.Type.SUCCESSFUL, ttl=ttl, return_value=result, pipeline=pipe,
                      worker_name=worker_name)
    else:
        # RQ's Job._handle_success without its `save`: that writes every field of the hash again,
        # the payload zlib-compressed again too (50 ms on the loop's thread for a 1M-character
        # text), where only the status and the end changed since the start
        job.set_status(JobStatus.FINISHED, pipeline=pipe)
        pipe.hset(job.key, "ended_at", utcformat(job.ended_at))
        Result.create(job, Result.Type.SUCCESSFUL, return_value=result, ttl=ttl, pipeline=pipe,
                      worker_name=worker_name, **_execution_args(claimed))
        if ttl != 0:
            job.finished_job_registry.add(job, ttl, pipe)
    _end_execution(claimed, pipe)


def store_failure(claimed: ClaimedJob, reason: str, worker_name: str, ttl: int, pipe: Any) -> None:
    job = claimed.job
    if job is not None:
        try:
            job.ended_at = now()
            job.set_status(JobStatus.FAILED, pipeline=pipe)
            pipe.hset(job.key, "ended_at", utcformat(job.ended_at))
            job.failure_ttl = ttl
            job._handle_failure(reason, pipe, worker_name=worker_name, **_execution_args(claimed))
            _end_execution(claimed, pipe)
            return
        except Exception:  # a hash odd enough to trip RQ's bookkeeping: record the failure plainly
            log.exception("job %s: RQ failure bookkeeping failed; recording the failure plainly", claimed.id)
    store_plain_failure(job_key(claimed.id), claimed.id, claimed.queue, reason, ttl, pipe)


def store_plain_failure(key: str | bytes, member: str | bytes, queue: str, reason: str, ttl: int,
                        pipe: Any) -> None:
    """A failure recorded without RQ's Job object (the hash is unreadable, or the id is not
    text): status, reason and the queue's failed registry, as `rq info` reads them."""
    pipe.hset(key, mapping={
        "status": JobStatus.FAILED.value,
        "exc_info": zlib.compress(reason.encode()),
        "ended_at": utcformat(now()),
    })
    pipe.expire(key, ttl)
    pipe.zadd(failed_registry_key(queue), {member: time.time() + ttl})


def _execution_args(claimed: ClaimedJob) -> dict[str, Any]:
    if claimed.execution is None:
        return {}
    return {"execution_id": claimed.execution.id, "execution_started_at": claimed.execution.created_at,
            "execution_ended_at": now()}


def _end_execution(claimed: ClaimedJob, pipe: Any) -> None:
    if claimed.execution is not None and claimed.job is not None:
        claimed.execution.delete(claimed.job, pipe)
        pipe.hdel(claimed.job.key, EXECUTION_FIELD)


def error_payload(reason: str, claimed: ClaimedJob, worker_name: str, backend: str) -> dict[str, Any]:
    return {"job_id": claimed.id, "error": reason, "worker": worker_name, "backend": backend,
            "attempt": claimed.attempt}
